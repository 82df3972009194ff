"""Train tiny-gemma4 (mtpkit/assets/tiny-gemma4) and its assistant
(mtpkit/assets/tiny-gemma4-assistant) on one CPU thread, in stages:

    python -m training.gemma4_train target            # the target: next-token loss
    python -m training.gemma4_train assistant ...     # the assistant on the frozen target

Every stage runs through training.loop (resumable: rerun the same command), deterministic
(fixed seeds, one thread, float32). The exact commands of the shipped checkpoints are in
their README.md. Models: training/gemma4_target.py, training/gemma4_assistant.py.
"""

import argparse
import dataclasses
import time
from pathlib import Path

import torch

from training import gemma4_target as target
from training import loop
from training.checkpoint import DTYPES
from training.corpus import heldout_windows, line_starts, load_split, sample_batch


@dataclasses.dataclass
class TargetArgs:
    size: str = target.DEFAULT_SIZE
    steps: int = 1500
    batch: int = 8
    seq_len: int = 256
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 0
    threads: int = 1
    work_dir: str = "/tmp/tiny-gemma4-run"
    out_dir: str = str(target.DEFAULT_OUT)
    save_every: int = 50
    eval_every: int = 250
    export_every: int = 500
    eval_windows: int = 16
    dtype: str = "bfloat16"
    top_level_fraction: float = 0.5


def target_stage(a: TargetArgs, log=print) -> loop.Stage:
    """Stage 1: the target from scratch, next-token cross-entropy on line-aligned windows
    (half of each batch at column-0 lines), as tiny-qwen3-next's stage 1."""
    t_start = time.time()
    kwargs = target.SIZES[a.size]
    data = load_split("train")
    starts = line_starts(data, a.seq_len)
    top_starts = line_starts(data, a.seq_len, top_level=True)
    val = heldout_windows(a.eval_windows, a.seq_len, a.seed)[:, :a.seq_len + 1]
    torch.manual_seed(a.seed)
    model = target.build_model(target.mtpkit_config(kwargs), a.seed)

    def step(i: int, g: torch.Generator):
        batch = sample_batch(data, a.batch, a.seq_len, g, starts, top_starts, a.top_level_fraction)
        loss = target.ntp_loss(model, batch[:, :a.seq_len + 1])
        return loss, {"ntp": loss.item()}

    n = sum(p.numel() for p in model.parameters())
    return loop.Stage(
        model=model, columns=("ntp",), step=step, evaluate=lambda: target.evaluate(model, val, a.batch),
        export=lambda d: target.export_checkpoint(model, kwargs, d, DTYPES[a.dtype]),
        tokens_per_step=a.batch * a.seq_len,
        summary={"stage": "target", "size": a.size, "parameters": n, "train_tokens_available": int(data.numel())},
        describe=f"target {a.size}: {n:,} parameters ({n * 2 / 1e6:.2f} MB in bf16); {data.numel():,} training "
                 f"tokens; {a.steps} steps of {a.batch}x{a.seq_len} tokens; data ready in "
                 f"{time.time() - t_start:.1f}s")


def _add_args(p: argparse.ArgumentParser, d) -> None:
    """One option per field of the dataclass instance d (--field-name)."""
    for f in dataclasses.fields(d):
        v = getattr(d, f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(v, bool):
            p.add_argument(flag, type=lambda s: s.lower() in ("1", "true", "yes"), default=v)
        elif isinstance(v, tuple):
            p.add_argument(flag, type=type(v[0]) if v else float, nargs="+", default=list(v))
        else:
            p.add_argument(flag, type=type(v) if v is not None else str, default=v)


def _parse(cls, ns: argparse.Namespace):
    vals = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)}
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in vals.items()})


STAGES = {"target": (TargetArgs, target_stage)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="stage", required=True)
    for name, (cls, _) in STAGES.items():
        sp = sub.add_parser(name, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        _add_args(sp, cls())
    ns = p.parse_args(argv)
    cls, build = STAGES[ns.stage]
    a = _parse(cls, ns)
    torch.set_num_threads(a.threads)

    def log(s: str) -> None:
        print(s, flush=True)

    loop.run(build(a, log), a, log)


if __name__ == "__main__":
    main()
