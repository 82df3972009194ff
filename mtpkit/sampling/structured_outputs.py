"""StructuredOutputs: the format a request's output must follow (vLLM's StructuredOutputsParams).

Exactly one of `json` (a JSON schema, dict or str), `json_object=True` (any JSON object),
`regex`, `grammar` (Lark, or llama.cpp's GBNF / EBNF) and `choice` (a list of strings). This is
the request's data only: the grammar library (llguidance) compiles it against the checkpoint's
tokenizer in mtpkit/structured/, once per distinct spec (`key`), and a spec it cannot compile is
an InputError raised by LLM._validate before anything is queued.
`disable_any_whitespace` (vLLM's name) makes JSON compact: no whitespace between tokens beyond
the separators "," and ":" (by default JSON may hold any whitespace there).
"""

import dataclasses
import json as _json

KINDS = ("json", "json_object", "regex", "grammar", "choice")


@dataclasses.dataclass
class StructuredOutputs:
    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    disable_any_whitespace: bool = False

    def given(self) -> list[str]:
        """The fields set (exactly one is valid)."""
        return [k for k in KINDS if (getattr(self, k) is not False if k == "json_object" else
                                     getattr(self, k) is not None)]

    def problems(self) -> list[str]:
        """What is wrong with the spec itself (before compiling), in the user's terms."""
        given = self.given()
        if len(given) != 1:
            return [f"structured_outputs must set exactly one of {', '.join(KINDS)}; "
                    + (f"it sets {', '.join(given)}" if given else "it sets none")]
        kind, out = given[0], []
        if not isinstance(self.disable_any_whitespace, bool):
            out.append(f"structured_outputs.disable_any_whitespace={self.disable_any_whitespace!r} must be a bool")
        v = getattr(self, kind)
        if kind == "json" and not isinstance(v, (dict, str)):
            out.append(f"structured_outputs.json must be a JSON schema (a dict or its JSON text), not "
                       f"{type(v).__name__}")
        elif kind == "json" and isinstance(v, str):
            try:
                _json.loads(v)
            except ValueError as e:
                out.append(f"structured_outputs.json is not JSON text ({e}); pass the schema as a dict or valid JSON")
        elif kind == "json_object" and v is not True:
            out.append(f"structured_outputs.json_object={v!r} must be True (or leave it unset)")
        elif kind in ("regex", "grammar") and (not isinstance(v, str) or not v):
            out.append(f"structured_outputs.{kind} must be a non-empty str")
        elif kind == "choice" and (not isinstance(v, (list, tuple)) or not v
                                   or not all(isinstance(c, str) and c for c in v)):
            out.append("structured_outputs.choice must be a non-empty list of non-empty strings")
        return out

    def key(self) -> tuple[str, str, bool]:
        """(kind, canonical text, disable_any_whitespace): equal for specs that compile to the same grammar (the cache key)."""
        kind = self.given()[0]
        v = getattr(self, kind)
        if kind == "json":
            v = _json.dumps(_json.loads(v) if isinstance(v, str) else v, sort_keys=True)
        elif kind == "json_object":
            v = '{"type": "object"}'
        elif kind == "choice":
            v = _json.dumps(list(v))
        return kind, v, bool(self.disable_any_whitespace) and kind in ("json", "json_object")

    def describe(self) -> str:
        """The spec in an error message (shortened)."""
        kind, text, _ = self.key()
        return f"{kind}={text if len(text) <= 120 else text[:117] + '...'}"
