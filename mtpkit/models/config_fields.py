"""Type and range checks of the config.json fields a family reads, all problems in one error.

A family declares a `Field` for every key its `from_dict` reads (tests/test_config_fields.py
checks that none is read undeclared). `check_fields` runs before any value is converted, so a
string where a number belongs, a negative head count or an eos id outside the vocabulary is a
ConfigError naming the field, its value and what it must be, never a RuntimeError from deep in
a model's constructor; and every problem of the file is listed at once.
"""

import dataclasses
import math

from mtpkit.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Field:
    kind: str                     # int, float, bool, str, dict, ints, strs, token_ids
    lo: float | None = None       # smallest allowed value (inclusive)
    hi: float | None = None       # largest allowed value (inclusive)
    positive: bool = False        # > 0 (floats: eps, theta)

    def problem(self, name: str, v, vocab: int | None) -> str | None:
        """What is wrong with value v of this field, or None."""
        def number(x, integer: bool) -> bool:
            if isinstance(x, bool):
                return False
            return isinstance(x, int) if integer else isinstance(x, (int, float)) and math.isfinite(x)

        kind = self.kind
        if kind in ("int", "float"):
            if not number(v, kind == "int"):
                return f"{name}={v!r} must be {'an integer' if kind == 'int' else 'a finite number'}"
            return self.range_problem(name, v)
        if kind == "bool":
            return None if isinstance(v, bool) else f"{name}={v!r} must be true or false"
        if kind == "str":
            return None if isinstance(v, str) else f"{name}={v!r} must be a string"
        if kind == "dict":
            return None if isinstance(v, dict) else f"{name}={v!r} must be an object"
        if kind == "strs":
            ok = isinstance(v, list) and all(isinstance(x, str) for x in v)
            return None if ok else f"{name}={_short(v)} must be a list of strings"
        if kind == "ints":
            if not (isinstance(v, list) and all(number(x, True) for x in v)):
                return f"{name}={_short(v)} must be a list of integers"
            return next((p for x in v if (p := self.range_problem(name, x, each=True))), None)
        if kind == "token_ids":   # one id or a list of them
            ids = v if isinstance(v, list) else [v]
            if not all(number(x, True) for x in ids):
                return f"{name}={_short(v)} must be a token id (an integer) or a list of them"
            hi = vocab - 1 if vocab is not None else None
            bad = [x for x in ids if x < 0 or (hi is not None and x > hi)]
            if bad:
                return f"{name}={_short(v)}: {bad[:8]} outside the vocabulary 0..{hi if hi is not None else '?'}"
            return None
        raise ValueError(f"unknown field kind {kind!r}")

    def range_problem(self, name: str, v, each: bool = False) -> str | None:
        what = f"every entry of {name}" if each else f"{name}={v!r}"
        if self.positive and not v > 0:
            return f"{what} must be > 0"
        if self.lo is not None and v < self.lo:
            return f"{what} must be >= {self.lo:g}" + (f" and <= {self.hi:g}" if self.hi is not None else "")
        if self.hi is not None and v > self.hi:
            return f"{what} must be <= {self.hi:g}" + (f" and >= {self.lo:g}" if self.lo is not None else "")
        return None


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def field_problems(raw: dict, schema: dict[str, Field], vocab_key: str = "vocab_size") -> list[str]:
    """Every problem of the fields present in raw (null counts as absent: the default applies)."""
    vocab = raw.get(vocab_key)
    vocab = vocab if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0 else None
    out = []
    for name, f in schema.items():
        if raw.get(name) is not None and (p := f.problem(name, raw[name], vocab)):
            out.append(p)
    return out


def raise_problems(where: str, problems: list[str]) -> None:
    if problems:
        one = len(problems) == 1
        raise ConfigError(f"{where}: " + (problems[0] if one else f"{len(problems)} problems:\n  - "
                                          + "\n  - ".join(problems)))


def check_fields(raw: dict, schema: dict[str, Field], where: str, vocab_key: str = "vocab_size") -> None:
    raise_problems(where, field_problems(raw, schema, vocab_key))


# Shorthands for the schemas
def count(lo: int = 1, hi: int | None = None) -> Field:
    return Field("int", lo=lo, hi=hi)


POSITIVE = Field("float", positive=True)
FLAG, TEXT, OBJECT, TOKEN_IDS = Field("bool"), Field("str"), Field("dict"), Field("token_ids")
