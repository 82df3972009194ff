"""The OpenAI API's request fields read into mtpkit's terms, and mtpkit's outputs written in the
API's shapes (completions, chat completions, their streaming chunks, logprobs, errors).

A field mtpkit has no control for is refused with a 400 naming it, unless it is at its default:
nothing is silently ignored. Fields that SamplingParams gains under the same name (vLLM's and
OpenAI's: n, min_p, penalties, logit_bias, ...) pass through (`PASS_THROUGH`); structured outputs come
from `response_format` or vLLM's `structured_outputs`.
"""

import dataclasses
import time
import uuid

from mtpkit.errors import InputError
from mtpkit.sampling.params import SamplingParams
from mtpkit.sampling.structured_outputs import KINDS, StructuredOutputs

# OpenAI / vLLM request fields read as the SamplingParams field of the same name, when it has one.
PASS_THROUGH = ("n", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                "logit_bias", "stop_token_ids", "ignore_eos", "min_tokens")
# Fields mtpkit cannot honour: refused unless at the value that means "off".
UNSUPPORTED = {"best_of": (None, 1), "echo": (None, False), "suffix": (None, ""), "tools": (None, []),
               "tool_choice": (None, "none"), "functions": (None,), "function_call": (None,),
               "logit_bias": (None, {}), "n": (None, 1),
               "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0)}
SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


class APIError(Exception):
    """An HTTP error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _stop_list(stop) -> list:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else stop


def structured_outputs(body: dict) -> StructuredOutputs | None:
    """OpenAI's `response_format` ({"type": "json_object"} or {"type": "json_schema",
    "json_schema": {"schema": ...}}; "text" is none) or vLLM's `structured_outputs` object
    (one of json, json_object, regex, grammar, choice; disable_any_whitespace), not both. The
    spec itself is compiled when the request is queued (a bad one is a 400 from its InputError)."""
    fmt, so = body.get("response_format"), body.get("structured_outputs")
    if fmt is not None and so is not None:
        raise APIError(400, "give response_format or structured_outputs, not both", param="response_format")
    if so is not None:
        if not isinstance(so, dict) or set(so) - {*KINDS, "disable_any_whitespace"}:
            raise APIError(400, f"structured_outputs must be an object with one of {', '.join(KINDS)} (and "
                                "optionally disable_any_whitespace)", param="structured_outputs")
        return StructuredOutputs(**so)
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise APIError(400, 'response_format {"type": "json_schema"} needs "json_schema": {"name": ..., '
                                '"schema": {...}}', param="response_format")
        return StructuredOutputs(json=spec["schema"])
    raise APIError(400, f"response_format={fmt!r}: type must be text, json_object or json_schema",
                   param="response_format")


def sampling_params(body: dict, defaults: dict, *, max_tokens_default: int | None, chat: bool) -> SamplingParams:
    """The request's SamplingParams (checked by LLM when the prompt is queued). `defaults`: the
    checkpoint's generation_config.json sampling fields; OpenAI's defaults (temperature 1,
    top_p 1) where it gives none."""
    for name, off in UNSUPPORTED.items():
        if name in body and body[name] not in off and not (name in PASS_THROUGH and name in SAMPLING_FIELDS):
            raise APIError(400, f"{name}={body[name]!r} is not supported by this server (mtpkit has no such "
                                f"control yet); leave it out", param=name)
    kw = {"temperature": 1.0, "top_p": 1.0, **defaults}
    for name in ("temperature", "top_p", "seed"):
        if body.get(name) is not None:
            kw[name] = body[name]
    for name in PASS_THROUGH:
        if body.get(name) is not None and name in SAMPLING_FIELDS:
            value = body[name]
            if name == "logit_bias" and isinstance(value, dict):   # JSON object keys are strings
                try:
                    value = {int(k): v for k, v in value.items()}
                except ValueError:
                    raise APIError(400, "logit_bias keys must be token ids", param="logit_bias") from None
            kw[name] = value
    max_tokens = body.get("max_completion_tokens") if chat else None
    max_tokens = body.get("max_tokens") if max_tokens is None else max_tokens
    if max_tokens is None:
        max_tokens = max_tokens_default
    if max_tokens is not None:
        kw["max_tokens"] = max_tokens
    kw["stop"] = _stop_list(body.get("stop"))
    if chat:
        if body.get("logprobs"):
            kw["logprobs"] = body.get("top_logprobs") or 0
        elif body.get("top_logprobs") is not None:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    elif body.get("logprobs") is not None:
        kw["logprobs"] = body["logprobs"]
    so = structured_outputs(body)
    if so is not None:
        kw["structured_outputs"] = so
    try:
        params = SamplingParams(**kw)
    except TypeError as e:
        raise APIError(400, f"bad sampling parameters: {e}") from None
    return params


def completion_prompts(body: dict) -> list:
    """`prompt`: a string, a list of strings, a list of token ids, or a list of such lists."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
            return prompt
    raise APIError(400, "prompt must be a string, a list of strings, a list of token ids or a list of such "
                        "lists", param="prompt")


def chat_messages(body: dict) -> list[dict]:
    """`messages` with every content a string (a list of text parts joined: no images here)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a string role", param="messages")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise APIError(400, f"messages[{i}].content: only text parts are supported", param="messages")
            content = "".join(p.get("text", "") for p in content)
        out.append({**m, "content": "" if content is None else content})
    return out


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# ---- logprobs -------------------------------------------------------------------------
def _token_text(tokenizer, token: int, lp) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([token]) if tokenizer is not None else str(token)


def _top(d: dict, n: int) -> list:
    """The top-n entries of one position's {token: Logprob} (rank order)."""
    ranked = sorted(((t, lp) for t, lp in d.items() if lp.rank is not None and lp.rank <= n), key=lambda x: x[1].rank)
    return ranked[:n]


def completion_logprobs(tokenizer, tokens: list[int], logprobs: list[dict], n: int, offset: int) -> dict:
    """The legacy completions `logprobs` object: tokens, token_logprobs, top_logprobs, text_offset."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, d in zip(tokens, logprobs):
        text = _token_text(tokenizer, t, d.get(t))
        out["tokens"].append(text)
        out["token_logprobs"].append(d[t].logprob)
        out["top_logprobs"].append({_token_text(tokenizer, u, lp): lp.logprob for u, lp in _top(d, n)})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def chat_logprobs(tokenizer, tokens: list[int], logprobs: list[dict], n: int) -> dict:
    """The chat completions `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def entry(t, lp):
        text = _token_text(tokenizer, t, lp)
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}
    return {"content": [{**entry(t, d[t]), "top_logprobs": [entry(u, lp) for u, lp in _top(d, n)]}
                        for t, d in zip(tokens, logprobs)]}


def check_n(params: SamplingParams) -> int:
    """The samples per prompt: SamplingParams.n where it exists (1 otherwise)."""
    n = getattr(params, "n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise InputError(f"n={n!r} must be an int >= 1")
    return n
