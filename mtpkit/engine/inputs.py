"""Prompts and sampling values from user code, read as the engine takes them: numpy and torch
values are accepted where they mean the same as a Python value, and anything else is an
InputError naming it.
"""

import dataclasses
import numbers
from typing import Sequence

import torch

from mtpkit.errors import InputError
from mtpkit.sampling.params import SamplingParams

# ---- input types ----------------------------------------------------------------------
# Prompts and sampling values come from user code: numpy and torch values are accepted where
# they mean the same as a Python value, and anything else is an InputError naming it.
PROMPT_TYPES = ("a str, a list of token ids (Python, numpy or torch integers), or a 1-D integer "
                "numpy array / torch tensor")


def short_repr(x) -> str:
    r = repr(x)
    return r if len(r) <= 60 else r[:57] + "..."


def is_array(x) -> bool:
    """A torch tensor or a numpy array / scalar (duck-typed: numpy is not imported here)."""
    return isinstance(x, torch.Tensor) or all(hasattr(x, a) for a in ("ndim", "dtype", "tolist"))


def is_bool(x) -> bool:
    """Python, numpy and torch booleans: never a number or a token id here."""
    return isinstance(x, bool) or (str(getattr(x, "dtype", "")) in ("bool", "torch.bool")
                                   and getattr(x, "ndim", 1) == 0)


def integer_dtype(dtype) -> bool:
    if isinstance(dtype, torch.dtype):
        return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
    return getattr(dtype, "kind", "") in ("i", "u")


def prompt_list(prompts) -> list:
    """A call's prompts as a list: a str, a token-id sequence or a 1-D array is one prompt,
    a list or tuple of those a batch (each checked later, naming its index)."""
    if isinstance(prompts, str) or (is_array(prompts) and prompts.ndim > 0):
        return [prompts]  # an array of another rank: id_sequence says what to pass
    if isinstance(prompts, (list, tuple)):
        first = prompts[0] if prompts else None
        if isinstance(first, numbers.Number) or (is_array(first) and first.ndim == 0):
            return [prompts]  # token ids (a bad id is reported by _tokens)
        return list(prompts)
    raise InputError(f"prompts={short_repr(prompts)} ({type(prompts).__name__}) is not a prompt or a list of "
                     f"prompts; give {PROMPT_TYPES}, or a list of these for a batch")


def id_sequence(prompt, where: str) -> list:
    """A token-id prompt's elements (not yet checked as ids)."""
    if is_array(prompt) and prompt.ndim > 0:
        if prompt.ndim != 1:
            raise InputError(f"{where}: a token-id array must be 1-D, got shape {tuple(prompt.shape)}; "
                             "pass a list of 1-D arrays for a batch")
        if len(prompt) and not integer_dtype(prompt.dtype):
            raise InputError(f"{where}: token ids must be integers, got an array of dtype {prompt.dtype}; "
                             "convert it (numpy: .astype(int), torch: .long())")
        return prompt.tolist()
    if isinstance(prompt, Sequence) and not isinstance(prompt, (str, bytes, bytearray)):
        return list(prompt)
    raise InputError(f"{where}: {short_repr(prompt)} ({type(prompt).__name__}) is not a prompt; give {PROMPT_TYPES}")


def utf8_text(text: str, where: str) -> str:
    """The text, if the tokenizer can take it: lone surrogates (from a bad decode) cannot be
    encoded as UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(f"{where}: the text is not valid Unicode ({e.reason}: {text[e.start:e.end]!r} at "
                         f"index {e.start}); remove it, or decode the source bytes with errors='replace'") from None
    return text


def scalar_value(v, integer: bool):
    """v as a Python int (integer) or float, if it is a Python, numpy or torch scalar of that
    kind; else None (SamplingParams.validate then names the field)."""
    if isinstance(v, torch.Tensor):
        if v.ndim != 0 or v.dtype == torch.bool or v.dtype.is_complex or (integer and v.dtype.is_floating_point):
            return None
        v = v.item()
    if isinstance(v, bool):
        return None
    if integer:
        return int(v) if isinstance(v, numbers.Integral) else None
    return float(v) if isinstance(v, numbers.Real) else None


def normalize_sampling_params(params) -> SamplingParams:
    """params (None: the defaults) with numpy / torch scalars as Python values, after the type
    checks SamplingParams.validate leaves to the caller: bools are not numbers or token ids,
    ignore_eos is a bool, stop_token_ids a list."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise InputError(f"sampling_params={short_repr(params)} ({type(params).__name__}) must be a SamplingParams "
                         "or a list of them, one per prompt; e.g. SamplingParams(**d) for a dict d")
    problems, values = [], {}
    for name, integer in (("max_tokens", True), ("top_k", True), ("seed", True), ("n", True), ("min_tokens", True),
                          ("temperature", False), ("top_p", False), ("min_p", False),
                          ("repetition_penalty", False), ("presence_penalty", False), ("frequency_penalty", False)):
        v = getattr(params, name)
        if is_bool(v):
            problems.append(f"{name}={v!r} must be {'an int' if integer else 'a number'}, not a bool")
        elif v is not None and (x := scalar_value(v, integer)) is not None:
            values[name] = x
    stop = params.stop_token_ids
    if is_array(stop) and stop.ndim == 1:
        stop = stop.tolist()
    if not isinstance(stop, (list, tuple)):
        problems.append(f"stop_token_ids={short_repr(stop)} must be a list of token ids, e.g. [{short_repr(stop)}]")
    elif any(is_bool(t) for t in stop):
        problems.append(f"stop_token_ids={short_repr(stop)} must be int token ids, not bools")
    else:
        values["stop_token_ids"] = [t if (x := scalar_value(t, True)) is None else x for t in stop]
    stop = [params.stop] if isinstance(params.stop, str) else params.stop  # one stop string
    if isinstance(stop, tuple):
        stop = list(stop)
    values["stop"] = stop
    if not is_bool(params.ignore_eos):
        problems.append(f"ignore_eos={short_repr(params.ignore_eos)} must be True or False")
    else:
        values["ignore_eos"] = bool(params.ignore_eos)
    for name in ("allowed_token_ids", "bad_words"):   # token ids as Python ints (numpy / torch ones too)
        v = getattr(params, name)
        if isinstance(v, (list, tuple)) or (is_array(v) and v.ndim == 1):
            values[name] = [_id_list(w) if isinstance(w, (list, tuple)) or is_array(w) else _id(w)
                            for w in (v.tolist() if is_array(v) else v)]
    if isinstance(params.logit_bias, dict):
        values["logit_bias"] = {_id(t): b if (x := scalar_value(b, False)) is None or is_bool(b) else x
                                for t, b in params.logit_bias.items()}
    if problems:
        raise InputError("invalid SamplingParams: " + "; ".join(problems))
    return dataclasses.replace(params, **values)


def _id(t):
    """A token id as a Python int when it is an integer scalar; else as given (validate names it)."""
    return t if is_bool(t) or (x := scalar_value(t, True)) is None else x


def _id_list(w) -> list:
    return [_id(t) for t in (w.tolist() if is_array(w) else w)]
