"""Chat templates: mtpkit renders a checkpoint's template exactly as transformers 5.24's
apply_chat_template does (text and token ids), for a Qwen3-style and a Gemma-style template
written here with the real templates' features; LLM.chat generates from the rendered ids."""

import json
import shutil

import pytest
from tokenizers import Tokenizer

from mtpkit import LLM, SamplingParams
from mtpkit.text.chat import load_chat_template, render_chat, select_template, special_tokens
from mtpkit.errors import InputError
from mtpkit.checkpoint.hub import ASSETS
from mtpkit.text.tokenizer import load_tokenizer

TINY = ASSETS / "tiny-qwen3-next"

# Qwen3's template without its tool-call branches: system message, the last user query found
# with a namespace, reasoning split out of assistant turns, enable_thinking.
QWEN3 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

# A template written with plain block tags, indented: it relies on trim_blocks and
# lstrip_blocks, as many hub templates do; an optional message key tested with `is defined`
# (a key whose value is None is absent).
BLOCKS = """{% for message in messages %}
  {% if message['role'] == 'system' %}
<<SYS>>{{ message['content'] }}<</SYS>>
  {% else %}
[{{ message['role'] }}{% if message['name'] is defined %} ({{ message['name'] }}){% endif %}] {{ message['content'] }}
  {% endif %}
{% endfor %}
{% if add_generation_prompt %}
[assistant]
{% endif %}
"""

# Gemma 3's template: bos from the tokenizer, the system message folded into the first user
# turn, roles that must alternate (raise_exception), assistant -> model, content as a string
# or a list of parts, trimmed.
GEMMA = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

CONVERSATIONS = {
    "qwen": [
        [{"role": "user", "content": "Write a haiku about tensors."}],
        [{"role": "system", "content": "You are terse."},
         {"role": "user", "content": "What is 2+2?"},
         {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
         {"role": "user", "content": "And 3+3?"}],
        [{"role": "system", "content": "Answer in French."},
         {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "<think>\ngreet back\n</think>\n\nBonjour !"},
         {"role": "user", "content": "Ça va ?", "name": None}],
        [{"role": "user", "content": "Weather in Zürich?"},
         {"role": "assistant", "content": "", "tool_calls": [
             {"type": "function", "function": {"name": "weather", "arguments": {"city": "Zürich", "days": 2}}}]},
         {"role": "tool", "content": "{\"temp\": 3}"},
         {"role": "tool", "content": "{\"temp\": 5}"},
         {"role": "assistant", "content": "Cold: 3 °C, then 5 °C.", "tool_calls": None}],
    ],
    "blocks": [
        [{"role": "system", "content": "S"}, {"role": "user", "content": "u1", "name": "ann"},
         {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2", "name": None}],
    ],
    "gemma": [
        [{"role": "user", "content": "  Tell me a joke.  "}],
        [{"role": "system", "content": "Be kind."},
         {"role": "user", "content": [{"type": "text", "text": "Hello"}]},
         {"role": "assistant", "content": "Hi! How can I help?"},
         {"role": "user", "content": "Explain MTP in one line."}],
    ],
}
TEMPLATES = {"qwen": QWEN3, "gemma": GEMMA, "blocks": BLOCKS}
SPECIAL = {"qwen": {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
           "gemma": {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"},
           "blocks": {"bos_token": "<bos>", "eos_token": "<eos>"}}


def _tokenizer_dir(tmp_path, kind: str, where: str):
    """The embedded tokenizer with the template's special tokens added; the template in
    tokenizer_config.json or chat_template.jinja."""
    d = tmp_path / kind
    d.mkdir()
    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<bos>", "<eos>", "<pad>", "<start_of_turn>",
                            "<end_of_turn>"])
    tok.save(str(d / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast",
           **{k: v for k, v in SPECIAL[kind].items() if v is not None}}
    if where == "tokenizer_config":
        cfg["chat_template"] = TEMPLATES[kind]
    else:
        (d / "chat_template.jinja").write_text(TEMPLATES[kind])
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("kind,where", [("qwen", "tokenizer_config"), ("gemma", "jinja"), ("blocks", "jinja")])
def test_templates_render_as_transformers_does(tmp_path, kind, where):
    from transformers import AutoTokenizer
    d = _tokenizer_dir(tmp_path, kind, where)
    hf = AutoTokenizer.from_pretrained(str(d))
    tok = load_tokenizer(d)
    source = select_template(load_chat_template(d), None, str(d))
    special = special_tokens(d)
    assert special == {k: v for k, v in SPECIAL[kind].items() if v is not None}
    for conv in CONVERSATIONS[kind]:
        for gen in (True, False):
            for extra in ({}, {"enable_thinking": False}):
                ours = render_chat(source, conv, add_generation_prompt=gen, special=special, **extra)
                theirs = hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen, **extra)
                assert ours == theirs
                hf_ids = hf.apply_chat_template(conv, tokenize=True, add_generation_prompt=gen, return_dict=False,
                                                **extra)
                assert tok.encode(ours, add_special_tokens=False).ids == list(hf_ids)
    # the special tokens are single tokens of the checkpoint's tokenizer, not their characters
    assert tok.token_to_id("<|im_start|>") in tok.encode(render_chat(
        QWEN3, CONVERSATIONS["qwen"][0], add_generation_prompt=True, special=special), add_special_tokens=False).ids


def test_template_errors_are_input_errors(tmp_path):
    with pytest.raises(InputError, match="roles must alternate"):
        render_chat(GEMMA, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
                    add_generation_prompt=True, special={"bos_token": "<bos>"})
    with pytest.raises(InputError, match="not valid Jinja"):
        render_chat("{% for m in messages %}", [{"role": "user", "content": "a"}], add_generation_prompt=True,
                    special={})
    # the sandbox: a template cannot reach Python internals
    with pytest.raises(Exception, match="unsafe|SecurityError|access"):
        render_chat("{{ messages.__class__.__mro__ }}", [{"role": "user", "content": "a"}],
                    add_generation_prompt=True, special={})


@pytest.fixture(scope="module")
def chat_llm(tmp_path_factory):
    """The embedded model with the Qwen-style template in tokenizer_config.json."""
    d = tmp_path_factory.mktemp("chat-model")
    for p in TINY.iterdir():
        if p.name not in ("README.md", "chat_template.jinja"):   # the .jinja file would come first
            (d / p.name).symlink_to(p)
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                         "eos_token": "<|endoftext|>", "chat_template": QWEN3}))
    return d, LLM(str(d), num_spec=2, max_model_len=256)


def test_chat_generates_from_the_rendered_conversation(chat_llm):
    from transformers import AutoTokenizer
    d, llm = chat_llm
    hf = AutoTokenizer.from_pretrained(str(d))
    convs = CONVERSATIONS["qwen"][:2]
    ids = [list(hf.apply_chat_template(c, tokenize=True, add_generation_prompt=True, return_dict=False))
           for c in convs]
    assert llm.apply_chat_template(convs) == ids
    sp = SamplingParams(max_tokens=12)
    outs = llm.chat(convs, sp)
    assert [o.prompt_token_ids for o in outs] == ids
    assert [o.token_ids for o in outs] == [o.token_ids for o in llm.generate(ids, sp)]
    one = llm.chat(convs[1], sp, chat_template_kwargs={"enable_thinking": False})
    assert len(one) == 1 and hf.decode(one[0].prompt_token_ids).endswith("<think>\n\n</think>\n\n")
    # chat_template= overrides the checkpoint's
    [o] = llm.chat(convs[0], sp, chat_template="{{ messages[0].content }}")
    assert o.prompt_token_ids == llm.tokenizer.encode(convs[0][0]["content"], add_special_tokens=False).ids


@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-gemma4"])
def test_the_embedded_models_chat_out_of_the_box(name):
    # their small template writes the conversation as Python comments (mtpkit/assets/*/chat_template.jinja)
    llm = LLM(name, max_model_len=96)
    conv = [{"role": "system", "content": "be\nbrief"}, {"role": "user", "content": "a stack"}]
    assert llm.apply_chat_template(conv, tokenize=False) == ["# system: be\n# brief\n# user: a stack\n# assistant:\n"]
    [o] = llm.chat(conv, SamplingParams(max_tokens=4, ignore_eos=True))
    assert o.prompt_token_ids == llm.apply_chat_template(conv)[0] and len(o.token_ids) == 4


def test_chat_without_a_template_says_what_to_do(tmp_path):
    for p in TINY.iterdir():   # the embedded model without its template
        if p.name != "chat_template.jinja":
            (tmp_path / p.name).symlink_to(p)
    llm = LLM(str(tmp_path), max_model_len=64)
    with pytest.raises(InputError, match="no chat template.*chat_template="):
        llm.chat([{"role": "user", "content": "hi"}])
    with pytest.raises(InputError, match="message dicts"):
        llm.chat([], chat_template="x")


def test_template_sources(tmp_path):
    # a list of named templates: "default" unless one is named; the processor's chat_template.json
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "default", "template": "D{{ messages[0].content }}"},
        {"name": "tool_use", "template": "T{{ messages[0].content }}"}]}))
    t = load_chat_template(tmp_path)
    conv = [{"role": "user", "content": "x"}]
    assert render_chat(select_template(t, None, "ckpt"), conv, add_generation_prompt=True, special={}) == "Dx"
    assert render_chat(select_template(t, "tool_use", "ckpt"), conv, add_generation_prompt=True, special={}) == "Tx"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "P{{ eos_token }}"}))
    assert render_chat(select_template(load_chat_template(tmp_path), None, "ckpt"), conv,
                       add_generation_prompt=True, special=special_tokens(tmp_path)) == "P<eos>"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert load_chat_template(tmp_path) == "J"       # the .jinja file comes first
