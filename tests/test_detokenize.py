"""The incremental detokenizer decodes a window at a time (text/detokenize.py DecodeWindow), not
the whole output at every step: fed any token sequence in any chunks, what it returns and its
`decoded` text are what decoding the whole sequence gives, for the embedded models' byte-level
tokenizers and for SentencePiece-style decoders that strip the first token's leading space
(Llama's Strip, Metaspace) or fuse byte-fallback tokens into characters."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models

from mtpkit import LLM, SamplingParams
from mtpkit.text.detokenize import IncrementalDetokenizer

PIECES = ["<unk>", "▁Hello", "▁world", "!", "<0xE4>", "<0xB8>", "<0xAD>", "▁", "a", "▁▁", "<0xE6>", "<0x96>", "<0x87>"]


def _piece_tokenizer(decoder) -> Tokenizer:
    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(PIECES)}, unk_token="<unk>"))
    tok.decoder = decoder
    return tok


TOKENIZERS = {
    "strip": _piece_tokenizer(decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                                 decoders.Strip(" ", 1, 0)])),
    "metaspace": _piece_tokenizer(decoders.Metaspace(replacement="▁", prepend_scheme="always")),
    "fallback": _piece_tokenizer(decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                                    decoders.Fuse()])),
}


@pytest.fixture(scope="module")
def embedded():
    with LLM("tiny-qwen3-next", enforce_eager=True, max_model_len=64) as q, \
            LLM("tiny-gemma4", enforce_eager=True, max_model_len=64) as g:
        yield {"tiny-qwen3-next": q.tokenizer, "tiny-gemma4": g.tokenizer}


def _check(tok, ids: list[int], rng: random.Random, stop=(), ends=None) -> None:
    """`ends`: the lengths at which ids[:n] is whole characters (None: every length). A partial
    byte-fallback character decodes to more U+FFFD whole than in windows."""
    d, deltas, i = IncrementalDetokenizer(tok, stop=stop), [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 2, 3, 5])
        deltas.append(d.add(ids[i:i + n]))
        i = min(i + n, len(ids))
        if ends is None or i in ends:
            assert d.decoded == tok.decode(ids[:i]), (ids[:i], d.decoded)
    deltas.append(d.add([], final=True))
    whole = tok.decode(ids)
    if stop:
        cut = min((whole.find(s) for s in stop if s in whole), default=-1)
        whole = whole if cut < 0 else whole[:cut]
    assert "".join(deltas) == d.text == whole


# Words: pieces, and characters as byte-fallback tokens (中, 文). A run of byte tokens that is not
# valid UTF-8 is not included: ByteFallback turns every byte of such a run into U+FFFD, so where
# a window boundary splits it the count of U+FFFD may differ from decoding it whole (the text
# around them does not).
WORDS = [[1], [2], [3], [7], [8], [9], [4, 5, 6], [10, 11, 12]]


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_piece_decoders(name):
    tok, rng = TOKENIZERS[name], random.Random(name)
    for _ in range(300):
        words = [rng.choice(WORDS) for _ in range(rng.randrange(1, 12))]
        ends = {sum(map(len, words[:j])) for j in range(len(words) + 1)}
        _check(tok, [t for w in words for t in w], rng, ends=ends)


@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-gemma4"])
def test_embedded_tokenizers(embedded, name):
    tok, rng = embedded[name], random.Random(name)
    texts = ["def f(x):\n    return x  # 中文 ü", "héllo wörld 😀!", "a\u00e9\u4e2d\U0001F600b"]
    for text in texts:
        ids = tok.encode(text).ids
        for _ in range(20):
            _check(tok, ids, rng)
            _check(tok, ids, rng, stop=["x ", "😀"])
    for _ in range(100):   # any ids, invalid UTF-8 included (the byte tokens in any order)
        _check(tok, [rng.randrange(3, 257) for _ in range(rng.randrange(1, 40))], rng)


def test_a_streams_outputs_text_is_the_decoded_output_at_every_event(embedded):
    with LLM("tiny-qwen3-next", num_spec=3, enforce_eager=True, max_model_len=128) as llm:
        for ev in llm.stream(["def fibonacci(n):", "import os\n"], SamplingParams(max_tokens=40, stop=["\n\n"])):
            out = ev.output
            whole = llm.tokenizer.decode(out.token_ids)
            assert out.text == whole.split("\n\n")[0]
