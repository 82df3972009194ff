"""Stop strings: a request ends when its generated text contains one of them.

The text is the decoded output, so a stop string matches across token boundaries. The output
text ends where the earliest occurrence of any stop string begins (the stop string is not
part of it); the tokens end with the one that completed it. Streaming never shows text a
later match would take back: besides the cut, it holds back the longest tail of the text that
is the start of a stop string, until the next token shows whether it becomes one.
"""

from collections.abc import Sequence

from .detokenize import REPLACEMENT


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


class StopStringMatcher:
    """Finds the token that completes a stop string in a request's output, step by step.

    Each step decodes the whole output once (a tokenizer's decode of a suffix of the ids can
    differ from the suffix of the text: a character split over tokens); only a step that holds
    a match decodes again, per new token, to find which one completed it."""

    def __init__(self, tokenizer, stops: Sequence[str]):
        self.tokenizer, self.stops = tokenizer, list(stops)
        self.longest = max(len(s) for s in self.stops)
        self.searched = 0   # no stop begins before this index of the output text

    def find(self, output_ids: list[int], num_new: int) -> int | None:
        """Index, among the last `num_new` of `output_ids`, of the token whose text completes
        the first stop string; None when the text holds none."""
        text = self.tokenizer.decode(output_ids)
        if first_stop(text, self.stops, self.searched) is None:
            # A later match can begin only in the last longest-1 settled characters or after
            # them (a trailing U+FFFD is a character not yet complete).
            settled = len(text.rstrip(REPLACEMENT))
            self.searched = max(self.searched, settled - self.longest + 1, 0)
            return None
        base = len(output_ids) - num_new
        for j in range(num_new - 1):
            if first_stop(self.tokenizer.decode(output_ids[:base + j + 1]), self.stops, self.searched) is not None:
                return j
        return num_new - 1
