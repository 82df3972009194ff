"""StructuredOutputs -> llguidance grammars, compiled once per distinct spec and checked.

A spec is compiled (`llguidance.grammar_from`), validated against the tokenizer, and a matcher
built from it must start without error and allow at least one token: anything else (a bad
regex or Lark grammar, an unsatisfiable schema such as minimum > maximum) is an InputError
naming the spec and the library's reason, raised before the request is queued. Compiled
grammars are cached by the spec's canonical text (`StructuredOutputs.key`), so a batch of
requests with one schema compiles it once; each request then gets its own matcher.
"""

import llguidance

from mtpkit.errors import InputError
from mtpkit.sampling.structured_outputs import StructuredOutputs
from mtpkit.structured.matcher import RequestGrammar

# StructuredOutputs field -> llguidance's grammar format
FORMATS = {"json": "json_schema", "json_object": "json_schema", "regex": "regex", "grammar": "grammar",
           "choice": "choice"}


class GrammarCompiler:
    def __init__(self, tokenizer: llguidance.LLTokenizer):
        self.tokenizer = tokenizer
        self._grammars: dict[tuple[str, str, bool], str] = {}

    def compile(self, spec: StructuredOutputs) -> str:
        """The llguidance grammar of `spec` (cached), or an InputError saying why it cannot be."""
        key = spec.key()
        if key in self._grammars:
            return self._grammars[key]
        kind, text, compact = key
        try:
            if compact:   # JSON without free whitespace (llguidance's whitespace_flexible off)
                grammar = llguidance.LLMatcher.grammar_from_json_schema(text, overrides={"whitespace_flexible": False})
            else:
                grammar = llguidance.grammar_from(FORMATS[kind], text)
        except ValueError as e:
            raise InputError(self._error(spec, str(e))) from None
        problem = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if not problem:
            m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            if m.is_error():
                problem = m.get_error()
            elif not any(m.compute_bitmask()):
                problem = "no token can start it"
        if problem:
            raise InputError(self._error(spec, one_line(problem)))
        self._grammars[key] = grammar
        return grammar

    def request_grammar(self, spec: StructuredOutputs) -> RequestGrammar:
        """A fresh matcher of `spec` for one request."""
        return RequestGrammar(llguidance.LLMatcher(self.tokenizer, self.compile(spec), log_level=0),
                              self.tokenizer.eos_tokens, self.tokenizer.vocab_size)

    @staticmethod
    def _error(spec: StructuredOutputs, why: str) -> str:
        return (f"structured_outputs {spec.describe()} cannot be compiled by llguidance: {why}; "
                "fix the spec (llguidance's syntax: https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md)")


def one_line(message: str) -> str:
    """llguidance's multi-line error without its source excerpt and caret lines."""
    keep = [ln.strip() for ln in message.splitlines()
            if ln.strip() and " | " not in ln and set(ln.strip()) != {"^"}]
    return " ".join(keep)[:400]
