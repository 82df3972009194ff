"""Train mtpkit's embedded default model (mtpkit/assets/tiny-qwen3-next) on CPU.

    python examples/train_tiny.py                 # stage 1: target + MTP head (about 30 minutes, 1 thread)
    python examples/train_tiny.py --init-from mtpkit/assets/tiny-qwen3-next --train-part mtp ...
                                                  # stage 2: the MTP head alone (the exact command:
                                                  # mtpkit/assets/tiny-qwen3-next/README.md)
    python examples/train_tiny.py --quick         # a 12-step smoke run into a temp directory
    python examples/train_tiny.py --bench         # throughput of the candidate sizes

Resumable: rerun the same command and it continues from --work-dir/train_state.pt.
See training/train.py for the corpus, split, tokenizer and losses.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # training/ is not installed

from training.train import main  # noqa: E402

if __name__ == "__main__":
    main()
