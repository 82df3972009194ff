"""The checkpoint's tokenizer.json, read and checked before any weight is (a file that cannot
be used is a CheckpointError naming it, not the tokenizers library's bare Exception after the
weights have loaded)."""

from pathlib import Path

from mtpkit.errors import CheckpointError


def load_tokenizer(path: Path, vocab_size: int | None = None):
    """`path`/tokenizer.json as a tokenizers.Tokenizer, or None when the checkpoint has none
    (prompts are then token ids). Its vocabulary must fit the model's `vocab_size`."""
    f = Path(path) / "tokenizer.json"
    if not f.exists():
        return None
    from tokenizers import Tokenizer
    try:
        tok = Tokenizer.from_file(str(f))
    except Exception as e:  # the tokenizers library raises a bare Exception ("... line 1 column 19")
        raise CheckpointError(f"{f} cannot be read as a tokenizer ({e}); it is truncated or corrupt: "
                              "copy it again, or remove it to pass token ids instead of text") from e
    n = tok.get_vocab_size(with_added_tokens=True)
    if vocab_size is not None and n > vocab_size:
        raise CheckpointError(f"{f} has {n} tokens but the model's vocab_size (config.json) is {vocab_size}: "
                              "the tokenizer does not belong to this checkpoint")
    return tok
