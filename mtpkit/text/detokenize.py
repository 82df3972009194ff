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


class DecodeWindow:
    """The text of a growing token sequence, decoded a window at a time, as serving engines
    detokenize: each new end decodes the window from the last settled boundary (`prefix`) and
    appends what it adds to the text decoded up to `read`; a window that ends in U+FFFD (a
    character not yet complete) waits for more tokens. A step then costs two small decodes
    whatever the sequence's length (decoding it whole at every step is quadratic in it), and for
    byte-level and SentencePiece-style decoders (a leading space stripped alike in both decodes)
    the text equals decoding the whole sequence. (Not where a run of byte-fallback tokens is not
    valid UTF-8: such a decoder turns each byte of the run into U+FFFD, and a boundary inside it
    may change how many.)"""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.text = ""   # the settled text: ids[:read] decoded
        self.prefix = self.read = 0

    def take(self, ids: list[int], n: int) -> str:
        """Take in ids[:n] (ids[:read] taken before); returns the unsettled tail as decoded
        now ("" once it settled), so that text + tail is ids[:n] decoded."""
        before = self.tokenizer.decode(ids[self.prefix:self.read]) if self.read > self.prefix else ""
        window = self.tokenizer.decode(ids[self.prefix:n])
        if len(window) > len(before) and not window.endswith(REPLACEMENT):
            self.text += window[len(before):]
            self.prefix, self.read = self.read, n
            return ""
        return window[len(before):]


class IncrementalDetokenizer:
    """Feed token ids with `add`; it returns the new final text (the delta). `text` is all the
    final text so far; after `add(..., final=True)` it is the whole decoded text. `decoded` is
    every id fed so far decoded (what tokenizer.decode of them gives), nothing held back.

    `tokenizer`: a tokenizers.Tokenizer (or anything with `decode(ids) -> str`), or None for a
    checkpoint without one (every delta is then ""). `stop`: the request's stop strings."""

    def __init__(self, tokenizer, token_ids=(), stop=()):
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.token_ids: list[int] = list(token_ids)
        self.text = ""
        self.decoded = ""
        self._window = DecodeWindow(tokenizer)

    def add(self, token_ids, final: bool = False) -> str:
        """Append `token_ids`; return the text that became final. `final=True` (no more tokens
        will come) releases whatever was held back."""
        self.token_ids.extend(token_ids)
        if self.tokenizer is None:
            return ""
        tail = self._window.take(self.token_ids, len(self.token_ids))
        decoded = self.decoded = self._window.text + tail
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
