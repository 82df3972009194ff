"""Stop strings: a request ends when its generated text contains one of them.

The text is the decoded output, so a stop string matches across token boundaries. The output
text ends where the earliest occurrence of any stop string begins (the stop string is not
part of it); the tokens end with the one that completed it. Streaming never shows text a
later match would take back: besides the cut, it holds back the longest tail of the text that
is the start of a stop string, until the next token shows whether it becomes one.
"""

from collections.abc import Sequence

from mtpkit.text.detokenize import DecodeWindow


def first_stop(text: str, stops: Sequence[str], start: int = 0) -> int | None:
    """Where the earliest occurrence of any stop string that begins at or after `start`
    begins, or None."""
    found = [i for s in stops if (i := text.find(s, start)) >= 0]
    return min(found) if found else None


def partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string (text a
    later token may complete into a stop)."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """The text before the first stop string (all of it without one)."""
    i = first_stop(text, stops) if stops else None
    return text if i is None else text[:i]


class Appended:
    """`ids + more` for len() and slices (no step), without copying `ids`: a request's whole output
    and a step's new tokens, of which the matcher's window reads only a short tail."""

    __slots__ = ("ids", "more")

    def __init__(self, ids: list[int], more: list[int]):
        self.ids, self.more = ids, more

    def __len__(self) -> int:
        return len(self.ids) + len(self.more)

    def __getitem__(self, s: slice) -> list[int]:
        start, stop, step = s.indices(len(self))
        if step != 1:
            raise ValueError("Appended takes slices without a step")
        n = len(self.ids)
        if stop <= n:
            return self.ids[start:stop]
        if start >= n:
            return self.more[start - n:stop - n]
        return self.ids[start:] + self.more[:stop - n]


class StopStringMatcher:
    """Finds the token that completes a stop string in a request's output, token by token.

    The text is built incrementally, token by token (text/detokenize.py DecodeWindow: a few
    small decodes per step whatever the output's length), and only its settled part is searched."""

    def __init__(self, tokenizer, stops: Sequence[str]):
        self.tokenizer, self.stops = tokenizer, list(stops)
        self.longest = max(len(s) for s in self.stops)
        self.window = DecodeWindow(tokenizer)   # .text: the output's settled text
        self.num_seen = 0       # tokens looked at
        self.searched = 0       # no stop begins before this index of the settled text

    @property
    def text(self) -> str:
        return self.window.text

    def find(self, output_ids: "list[int] | Appended", num_new: int) -> int | None:
        """Index, among the last `num_new` of `output_ids` (the earlier ones were given
        before), of the token whose text completes the first stop string; None if none
        does. (A step's caller passes Appended(output, new tokens): only a tail is read, so a
        step's work does not grow with the output.)"""
        base = len(output_ids) - num_new
        if self.num_seen > base:
            # It saw tokens that were not kept (a step interrupted between matching and
            # appending): start over from the output as it is.
            self.__init__(self.tokenizer, self.stops)
        for n in range(self.num_seen + 1, len(output_ids) + 1):
            self.window.take(output_ids, n)
            self.num_seen = n
            if first_stop(self.text, self.stops, self.searched) is not None:
                return max(n - 1 - base, 0)
            # a later match can begin only in the last longest-1 characters or after them
            self.searched = max(self.searched, len(self.text) - self.longest + 1)
        return None
