"""Incremental detokenization: text that is final, as token ids arrive.

A byte-level tokenizer can split one character over several tokens (a CJK character is three
UTF-8 bytes, each possibly its own token). Decoding the ids seen so far then ends in U+FFFD
(the decoder's replacement for an incomplete UTF-8 sequence), which the next token may turn
into the real character. Printing `text[len(shown):]` after every token would print that
U+FFFD for good. `IncrementalDetokenizer` holds back a trailing U+FFFD until a later token (or
the end of the sequence) settles it, so what it has returned is always a prefix of the final
text, and the returned pieces concatenate to the final decoded text.

With stop strings (`stop`), the text also ends before the first stop string, and a tail that
may still become one is held back too (see text/stop_strings.py).
"""

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Feed token ids with `add`; it returns the new final text (the delta). `text` is all the
    final text so far; after `add(..., final=True)` it is the whole decoded text.

    `tokenizer`: a tokenizers.Tokenizer (or anything with `decode(ids) -> str`), or None for a
    checkpoint without one (every delta is then ""). `stop`: the request's stop strings."""

    def __init__(self, tokenizer, token_ids=(), stop=()):
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.token_ids: list[int] = list(token_ids)
        self.text = ""

    def add(self, token_ids, final: bool = False) -> str:
        """Append `token_ids`; return the text that became final. `final=True` (no more tokens
        will come) releases whatever was held back."""
        self.token_ids.extend(token_ids)
        if self.tokenizer is None:
            return ""
        decoded = self.tokenizer.decode(self.token_ids)
        # A trailing U+FFFD may be an incomplete character a later token completes: hold it.
        ready = decoded if final else decoded.rstrip(REPLACEMENT)
        if self.stop:
            from mtpkit.text.stop_strings import first_stop, partial_stop_len  # here: stop_strings imports this module
            cut = first_stop(ready, self.stop)
            if cut is not None:
                ready = ready[:cut]
            elif not final:
                ready = ready[:len(ready) - partial_stop_len(ready, self.stop)]
        if not ready.startswith(self.text):
            # A decoder that rewrites earlier text (not the byte-level one): what was returned
            # cannot be taken back, so wait until the text agrees with it again.
            return ""
        delta = ready[len(self.text):]
        self.text = ready
        return delta
