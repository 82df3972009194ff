"""Train mtpkit's embedded default model (mtpkit/assets/tiny-qwen3-next) on CPU.

    python examples/train_tiny.py                 # the full run (about 30 minutes, 1 thread)
    python examples/train_tiny.py --quick         # a 12-step smoke run into a temp directory
    python examples/train_tiny.py --bench         # throughput of the candidate sizes

Resumable: rerun the same command and it continues from --work-dir/train_state.pt.
See mtpkit/train.py for the corpus, split, tokenizer and losses.
"""

from mtpkit.train import main

if __name__ == "__main__":
    main()
