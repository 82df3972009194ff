"""The grammar library's view of the checkpoint's tokenizer, built from its tokenizer.json.

llguidance reads a Hugging Face tokenizer.json itself (byte-level BPE, SentencePiece-style byte
fallback, added and special tokens), so the view is built from the `tokenizers.Tokenizer` the
facade loaded (text/tokenizer.py), serialized back to its JSON: no transformers. The embedded
models' byte vocabulary (256 byte tokens + <|endoftext|>) is a byte-level BPE without merges,
which it reads like any other. `n_vocab` is the model's vocab_size, which may exceed the
tokenizer's (tiny-gemma4: 272 rows for 257 tokens): the rows without a token are never allowed.
The eos tokens are the request's (the checkpoint's generation defaults): the grammar allows
them exactly when the structure is complete.
"""

import llguidance


def grammar_tokenizer(tokenizer, vocab_size: int, eos_token_ids) -> llguidance.LLTokenizer:
    """An LLTokenizer over `tokenizer` (a tokenizers.Tokenizer) with the model's vocabulary size."""
    eos = [int(t) for t in eos_token_ids]
    return llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size, eos_token=eos or None)
