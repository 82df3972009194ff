"""Structured outputs with llguidance: the tokenizer view, the compiled grammars, each request's
matcher and the masks of a step (verify bundles included)."""
