"""The training corpus, its held-out split, the byte-level tokenizer and training windows,
shared by every embedded model's training (training.train: tiny-qwen3-next;
training.gemma4_train: tiny-gemma4 and its assistant).

Corpus: the Python standard library of the running interpreter: every `*.py` file under
`sysconfig.get_paths()["stdlib"]` except third-party `site-packages` / `dist-packages`
folders, sorted by path relative to that directory (POSIX form). Held-out split: the file
at 0-based index i of that list is held out when i % 20 == 0 (`HELDOUT_EVERY`), the rest
train. A split is the concatenation of its files' raw bytes, each followed by <|endoftext|>.

Tokenizer: byte level, token id = byte value (0..255), plus <|endoftext|> = 256, written as a
`tokenizers` BPE model without merges and with byte-level pre-tokenizer/decoder: any UTF-8
text encodes to exactly its bytes and decodes back unchanged. (A model may have more
embedding rows than the tokenizer's 257 ids: tiny-gemma4 pads its vocabulary.)

Windows of T + 2 tokens start at random line starts of the training stream, half of every
batch at lines that start at column 0 (`line_starts`): prompts start at a line, usually with
top-level code, and the model should take the start of a sequence to mean that.
"""

import sysconfig
from pathlib import Path

import torch

from mtpkit.shapes import Int, Tensor

EOS_TOKEN = "<|endoftext|>"
EOS_ID = 256
VOCAB_SIZE = 257
HELDOUT_EVERY = 20


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path | None = None) -> list[Path]:
    """Every *.py file of the standard library, sorted by relative POSIX path, without the
    third-party site-packages / dist-packages folders that may sit inside it."""
    root = root or stdlib_dir()
    files = [p for p in root.rglob("*.py")
             if p.is_file() and not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def split_files(files: list[Path]) -> tuple[list[Path], list[Path]]:
    """(train, heldout): file i (0-based, in corpus_files order) is held out when i % 20 == 0."""
    train = [f for i, f in enumerate(files) if i % HELDOUT_EVERY != 0]
    heldout = [f for i, f in enumerate(files) if i % HELDOUT_EVERY == 0]
    return train, heldout


def encode_bytes(data: bytes) -> list[int]:
    """The tokenizer's encoding of UTF-8 text, computed from its bytes (id = byte value)."""
    return list(data)


def load_split(split: str, root: Path | None = None) -> torch.Tensor:
    """int16 token stream of a split: file bytes, each file followed by <|endoftext|>."""
    train, heldout = split_files(corpus_files(root))
    files = {"train": train, "heldout": heldout}[split]
    data, ends = bytearray(), []
    for f in files:
        data += f.read_bytes()
        ends.append(len(data))
    out = torch.frombuffer(data, dtype=torch.uint8).to(torch.int16) if data else torch.zeros(0, dtype=torch.int16)
    # Insert <|endoftext|> after every file: file k's bytes shift right by k.
    ends_t = torch.tensor(ends, dtype=torch.int64)
    eos_at = ends_t + torch.arange(len(ends))
    stream = torch.full((len(data) + len(ends),), EOS_ID, dtype=torch.int16)
    keep = torch.ones(stream.numel(), dtype=torch.bool)
    keep[eos_at] = False
    stream[keep] = out
    return stream


def heldout_documents(root: Path | None = None) -> list[tuple[str, bytes]]:
    """(relative path, bytes) of every held-out file."""
    root = root or stdlib_dir()
    _, heldout = split_files(corpus_files(root))
    return [(f.relative_to(root).as_posix(), f.read_bytes()) for f in heldout]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (what ByteLevel uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def build_tokenizer():
    """Byte-level tokenizer: id = byte value, <|endoftext|> = 256, exact UTF-8 round trip."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    table = _bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOS_TOKEN, special=True, normalized=False)])
    assert tok.token_to_id(EOS_TOKEN) == EOS_ID and tok.get_vocab_size() == VOCAB_SIZE
    return tok


def check_tokenizer(tok, texts: list[str]) -> None:
    """Every text must encode to its UTF-8 bytes and decode back unchanged."""
    for t in texts:
        ids = tok.encode(t).ids
        if ids != list(t.encode("utf-8")):
            raise AssertionError(f"tokenizer does not encode {t[:40]!r} to its bytes")
        if tok.decode(ids) != t:
            raise AssertionError(f"tokenizer does not round-trip {t[:40]!r}")


def tokenizer_probe_texts(seed: int = 0) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    texts = ["", " ", "  leading and trailing  ", "def f(x):\n\treturn x  # done\r\n",
             "naïve café — ünïcödé ✓ 日本語 한국어 🐍🚀 \x00\x01\x7f", "\u200b\ufeff\U0010ffff"]
    for n in (1, 7, 64, 300):  # random code points of every UTF-8 length (no surrogates)
        cps = torch.randint(0, 0x10FFFF, (n,), generator=g).tolist()
        texts.append("".join(chr(c) for c in cps if not 0xD800 <= c <= 0xDFFF))
        ascii_ = torch.randint(0, 128, (n,), generator=g).tolist()
        texts.append("".join(chr(c) for c in ascii_))
    return texts


def line_starts(data: Int[Tensor, "seq_len"], T: int, top_level: bool = False) -> Int[Tensor, "..."]:
    """Offsets of every line start (after a newline or <|endoftext|>, and 0) that leaves room
    for a window of T + 2 tokens; with top_level, only lines that start with code at column 0
    (not a space, tab, newline or <|endoftext|>)."""
    prev = data[:-1]
    starts = torch.nonzero((prev == ord("\n")) | (prev == EOS_ID)).flatten() + 1
    starts = torch.cat([torch.zeros(1, dtype=starts.dtype), starts])
    starts = starts[starts <= data.numel() - (T + 2)]
    if top_level:
        first = data[starts].long()
        starts = starts[(first != ord(" ")) & (first != ord("\t")) & (first != ord("\n")) & (first != EOS_ID)]
    return starts


def sample_batch(data: Int[Tensor, "seq_len"], B: int, T: int, g: torch.Generator,
                 starts: Int[Tensor, "..."] | None = None, top_starts: Int[Tensor, "..."] | None = None,
                 top_fraction: float = 0.0) -> Int[Tensor, "num_reqs seq_len"]:
    """B windows of T + 2 tokens at random offsets, or at random entries of `starts`; the
    first round(B * top_fraction) of them at random entries of `top_starts`."""
    n_top = round(B * top_fraction) if top_starts is not None else 0
    if starts is None:
        offsets = torch.randint(0, data.numel() - (T + 2), (B - n_top,), generator=g)
    else:
        offsets = starts[torch.randint(0, starts.numel(), (B - n_top,), generator=g)]
    if n_top:
        offsets = torch.cat([top_starts[torch.randint(0, top_starts.numel(), (n_top,), generator=g)], offsets])
    return torch.stack([data[s:s + T + 2] for s in offsets.tolist()]).long()


def sample_generated(seqs: Int[Tensor, "num_seqs total_len"], B: int, T: int, g: torch.Generator
                     ) -> Int[Tensor, "num_reqs seq_len"]:
    """B windows of T + 2 tokens at random offsets of random generated sequences."""
    rows = torch.randint(0, seqs.shape[0], (B,), generator=g)
    offsets = torch.randint(0, seqs.shape[1] - (T + 2) + 1, (B,), generator=g)
    return torch.stack([seqs[r, o:o + T + 2] for r, o in zip(rows.tolist(), offsets.tolist())]).long()


def heldout_windows(n: int, T: int, seed: int) -> torch.Tensor:
    data = load_split("heldout")
    return sample_batch(data, n, T, torch.Generator().manual_seed(seed + 12345))


def spaced_heldout_windows(num: int, T: int) -> torch.Tensor:
    """`num` windows of T + 2 tokens at evenly spaced offsets of the held-out stream (the
    benchmarks' teacher-forced evaluation)."""
    data = load_split("heldout")
    starts = torch.linspace(0, data.numel() - (T + 2), num).long().tolist()
    return torch.stack([data[s:s + T + 2] for s in starts]).long()


def heldout_prompts(num: int, length: int) -> list[tuple[str, list[int]]]:
    """`num` prompts of `length` tokens from evenly spaced held-out files (those long enough):
    each starts at the first line start after a third of its file."""
    docs = [(name, data) for name, data in heldout_documents() if len(data) >= 3 * length]
    pick = [docs[int(i * len(docs) / num)] for i in range(num)]
    prompts = []
    for name, data in pick:
        start = data.find(b"\n", len(data) // 3) + 1
        prompts.append((name, list(data[start:start + length])))
    return prompts
