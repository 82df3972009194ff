"""Chat templates: the checkpoint's Jinja template rendered the way transformers renders it.

A template is untrusted code from a hub repo, so it runs in jinja2's immutable sandbox. The
environment matches transformers' `apply_chat_template` (`transformers.utils.chat_template_utils`,
5.24): trim_blocks and lstrip_blocks, the loopcontrols extension, a `{% generation %}` block
(rendered as its body), a `tojson` filter that does not escape HTML, the `raise_exception`
and `strftime_now` functions, and `dict` / `namespace` that cannot reach Python internals.
Variables: `messages` (keys whose value is None dropped; reasoning under any of its names is
also `reasoning_content` and `thinking`), `add_generation_prompt`, `tools`, `documents`, the
tokenizer's special tokens (`bos_token`, `eos_token`, ...) as strings, and extra keyword
arguments. The rendered text is tokenized without adding special tokens again: the template
writes them.
"""

import datetime
import functools
import json
from pathlib import Path

from mtpkit.errors import CheckpointError, InputError

# The named special tokens transformers passes to a template (SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _read_json(f: Path) -> dict:
    try:
        return json.loads(f.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f} is not valid JSON ({e}); copy it again") from None


def _token_text(v) -> str | None:
    # tokenizer files write a token as its string or as an AddedToken dict
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def special_tokens(path: Path) -> dict[str, str]:
    """The named special tokens of a checkpoint's tokenizer files (tokenizer_config.json,
    then special_tokens_map.json over it, as transformers reads them), as strings."""
    out = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        f = Path(path) / name
        if f.exists():
            cfg = _read_json(f)
            for key in SPECIAL_TOKEN_NAMES:
                if (text := _token_text(cfg.get(key))) is not None:
                    out[key] = text
    return out


def load_chat_template(path: Path) -> str | dict[str, str] | None:
    """The checkpoint's chat template: chat_template.jinja, else the `chat_template` of
    tokenizer_config.json (a string, or a list of {name, template}: returned as a dict), else
    that of chat_template.json (a multimodal processor's), else None."""
    path = Path(path)
    f = path / "chat_template.jinja"
    if f.exists():
        return f.read_text(encoding="utf-8")
    for f in (path / "tokenizer_config.json", path / "chat_template.json"):
        t = _read_json(f).get("chat_template") if f.exists() else None
        if isinstance(t, list):
            try:
                return {d["name"]: d["template"] for d in t}
            except (TypeError, KeyError):
                raise CheckpointError(f"{f}: chat_template is a list but not of {{name, template}} entries") from None
        if isinstance(t, str):
            return t
    return None


def select_template(template: str | dict[str, str] | None, chat_template: str | None, where: str) -> str:
    """The template text to render: `chat_template` (a template, or the name of one of the
    checkpoint's templates) over the checkpoint's own (its "default" when it has several)."""
    if isinstance(template, dict):
        if chat_template in template:
            return template[chat_template]
        if chat_template is None:
            if "default" in template:
                return template["default"]
            raise InputError(f"{where} has several chat templates ({', '.join(sorted(template))}) and none is "
                             "named 'default': pass chat_template= with one of these names")
    if chat_template is not None:
        return chat_template
    if template is None:
        raise InputError(f"{where} has no chat template (no chat_template.jinja, no chat_template in "
                         "tokenizer_config.json): pass chat_template= (a Jinja template), or use generate() "
                         "with a prompt you format yourself")
    return template


@functools.lru_cache(maxsize=16)
def compile_template(source: str):
    """A compiled template in transformers' sandboxed environment."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant text for training masks;
        # rendering keeps its body.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters, which templates do not expect
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    class TemplateDict:
        # dict() without the type itself, whose attributes lead out of the sandbox
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        # no underscore attributes: they reach CPython internals
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace)
    return env.from_string(source)


def _message(m, where: str) -> dict:
    """A message as the template sees it (a copy: the caller's is not changed)."""
    if not isinstance(m, dict):
        raise InputError(f"{where}: a message must be a dict such as {{'role': 'user', 'content': '...'}}, "
                         f"got {type(m).__name__}")
    m = {k: v for k, v in m.items() if v is not None}
    reasoning = next((m[k] for k in REASONING_FIELDS if k in m), None)
    if reasoning is not None:
        m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
    return m


def conversation_list(messages) -> list[list[dict]]:
    """A conversation (a list of message dicts) or a list of conversations, as a list of
    conversations, each checked (a non-empty list of dicts)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InputError("messages must be a non-empty list of message dicts (one conversation) or a list of "
                         "such lists (a batch)")
    batch = isinstance(messages[0], (list, tuple))
    convs = list(messages) if batch else [messages]
    out = []
    for i, conv in enumerate(convs):
        where = f"conversation {i}" if batch else "conversation"
        if not isinstance(conv, (list, tuple)) or not conv:
            raise InputError(f"{where}: must be a non-empty list of message dicts")
        for j, m in enumerate(conv):
            _message(m, f"{where}, message {j}")
        out.append(list(conv))
    return out


def render_chat(source: str, conversation: list[dict], *, add_generation_prompt: bool,
                special: dict[str, str], where: str = "conversation", **kwargs) -> str:
    """One conversation rendered as text by the template `source`. A template that raises
    (`raise_exception`, a Jinja error) is an InputError naming the conversation."""
    import jinja2
    try:
        template = compile_template(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise InputError(f"the chat template is not valid Jinja (line {e.lineno}: {e.message}); pass a "
                         "working one as chat_template=") from None
    conversation = [_message(m, f"{where}, message {j}") for j, m in enumerate(conversation)]
    variables = {**special, **kwargs}
    try:
        return template.render(messages=conversation, tools=variables.pop("tools", None),
                               documents=variables.pop("documents", None),
                               add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.TemplateError as e:
        raise InputError(f"{where}: the chat template refused it: {e}") from None
