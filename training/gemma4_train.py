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

from training import gemma4_assistant as assistant
from training import gemma4_assistant_io as assistant_io
from training import gemma4_target as target
from training import loop
from training.checkpoint import DTYPES
from training.corpus import heldout_windows, line_starts, load_split, sample_batch, sample_generated


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


@dataclasses.dataclass
class AssistantArgs:
    target: str = str(target.DEFAULT_OUT)   # the frozen target's checkpoint
    size: str = assistant.DEFAULT_SIZE
    init_from: str = ""                     # an assistant checkpoint to continue from
    from_target: bool = True                # warm start from the target (build_assistant)
    steps: int = 1000
    batch: int = 8
    seq_len: int = 256                      # target positions per window
    queries: int = 64                       # rounds drawn per window (0: all seq_len - 1)
    step_weights: tuple[float, ...] = (1.0, 0.8, 0.6, 0.5, 0.4, 0.3)   # one per draft step (their number: depth)
    distill: float = 0.7
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup: int = 30
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 1
    threads: int = 1
    work_dir: str = "/tmp/tiny-gemma4-assistant-run"
    out_dir: str = str(assistant.DEFAULT_OUT)
    save_every: int = 50
    eval_every: int = 250
    export_every: int = 500
    eval_windows: int = 16
    dtype: str = "bfloat16"
    top_level_fraction: float = 0.5
    generated_fraction: float = 0.5         # share of each batch from the target's greedy continuations
    generated_prompts: int = 2000
    generated_tokens: int = 200


def load_target(path: Path):
    """The frozen target (float32, no gradients) and the kwargs it was made from."""
    m = target.Gemma4ForCausalLM(target.config_of(path), ops=target.TORCH)
    target.load_into(m, path)
    kwargs = next((k for k in target.SIZES.values() if target.mtpkit_config(k) == m.cfg), None)
    if kwargs is None:
        raise SystemExit(f"{path} is not a checkpoint of any target size in training/gemma4_target.py")
    return m.eval(), kwargs


def assistant_stage(a: AssistantArgs, log=print) -> loop.Stage:
    """The assistant on the frozen target: draft steps 1..depth unrolled as at inference,
    teacher-forced (training/gemma4_assistant.py, draft_losses)."""
    from training.train import cached_continuations

    t_start = time.time()
    tgt, tkw = load_target(Path(a.target))
    size = assistant.SIZES[a.size]
    depth = len(a.step_weights)
    width = a.seq_len + depth - 2                  # sample_batch windows hold width + 2 tokens
    data = load_split("train")
    starts = line_starts(data, width)
    top_starts = line_starts(data, width, top_level=True)
    val = heldout_windows(a.eval_windows, width, a.seed)
    torch.manual_seed(a.seed)
    cfg = assistant.AssistantConfig.from_dict(assistant_io.hf_config(tkw, size).to_dict())
    if a.init_from:
        asst = assistant_io.load_assistant(Path(a.init_from), tgt)
        if dataclasses.replace(asst.cfg, num_centroids=0, centroid_top_k=0) != cfg:
            raise SystemExit(f"{a.init_from} is not an assistant of --size {a.size}")
    else:
        asst = assistant_io.build_assistant(cfg, tgt, a.seed, from_target=a.from_target)
    for n, p in asst.named_parameters():
        p.requires_grad_(n != "centroids.weight")
    generated, n_gen = None, round(a.batch * a.generated_fraction)
    if n_gen:
        generated = cached_continuations(Path(a.work_dir), Path(a.target), a.generated_prompts, a.generated_tokens,
                                         a.seed, width, log, num_spec=0)
    queries = a.queries or None

    def step(i: int, g: torch.Generator):
        batch = sample_batch(data, a.batch, width, g, starts, top_starts, a.top_level_fraction)
        if generated is not None:  # the last n_gen windows from the target's own continuations
            batch[a.batch - n_gen:] = sample_generated(generated, n_gen, width, g)
        losses = assistant.draft_losses(asst, tgt, batch, a.seq_len, depth, a.distill, queries, g)
        loss = sum(w * l for w, l in zip(a.step_weights, losses))
        return loss, {f"step{k + 1}": l.item() for k, l in enumerate(losses)}

    n = sum(p.numel() for p in asst.parameters())
    return loop.Stage(
        model=asst, columns=tuple(f"step{k + 1}" for k in range(depth)), step=step,
        evaluate=lambda: assistant.evaluate(asst, tgt, val, a.seq_len, depth, a.batch),
        export=lambda d: assistant_io.export_checkpoint(asst, tkw, size, tgt, d, DTYPES[a.dtype]),
        tokens_per_step=a.batch * (queries or a.seq_len - 1),
        summary={"stage": "assistant", "size": a.size, "parameters": n},
        describe=f"assistant {a.size}: {n:,} parameters ({n * 2 / 1e6:.2f} MB in bf16) on target {a.target}; "
                 f"{a.steps} steps of {a.batch} windows x {queries or a.seq_len - 1} rounds x {depth} draft steps; "
                 f"data ready in {time.time() - t_start:.1f}s")


@dataclasses.dataclass
class CentroidArgs:
    target: str = str(target.DEFAULT_OUT)
    init_from: str = str(assistant.DEFAULT_OUT)   # a plain (tied-head) assistant checkpoint
    num_centroids: int = 16
    top_k: int = 4                                # centroid_intermediate_top_k
    steps: int = 300
    batch: int = 8
    seq_len: int = 256
    queries: int = 64
    depth: int = 4                                # draft steps whose states train the centroids
    lr: float = 1e-2
    min_lr_ratio: float = 0.1
    warmup: int = 20
    weight_decay: float = 0.0
    clip: float = 1.0
    seed: int = 3
    threads: int = 1
    work_dir: str = "/tmp/tiny-gemma4-centroids-run"
    out_dir: str = "/tmp/tiny-gemma4-assistant-centroids"
    save_every: int = 50
    eval_every: int = 100
    export_every: int = 10**9
    eval_windows: int = 16
    dtype: str = "bfloat16"
    top_level_fraction: float = 0.5
    generated_fraction: float = 0.5
    generated_file: str = "/tmp/tiny-gemma4-assistant-run/generated.pt"   # the assistant stage's (work dir)


def centroid_stage(a: CentroidArgs, log=print) -> loop.Stage:
    """The ordered-embedding head of a trained plain assistant: token_ordering by balanced
    k-means of its head, centroids trained to keep its own argmax (training/gemma4_centroids.py);
    nothing else changes."""
    from training import gemma4_centroids as cen

    tgt, tkw = load_target(Path(a.target))
    plain = assistant_io.load_assistant(Path(a.init_from), tgt)
    if plain.cfg.num_centroids:
        raise SystemExit(f"{a.init_from} already has centroids: give a plain assistant")
    size = next(k for k, v in assistant.SIZES.items()
                if assistant.AssistantConfig.from_dict(assistant_io.hf_config(tkw, v).to_dict()) == plain.cfg)
    asst = cen.with_centroids(plain, tgt.cfg, a.num_centroids, a.top_k, a.seed)
    for n, p in asst.named_parameters():
        p.requires_grad_(n == "centroids.weight")
    width = a.seq_len + a.depth - 2
    data = load_split("train")
    starts, top_starts = line_starts(data, width), line_starts(data, width, top_level=True)
    val = heldout_windows(a.eval_windows, width, a.seed)
    n_gen = round(a.batch * a.generated_fraction)
    generated = torch.load(a.generated_file) if n_gen else None

    def step(i: int, g: torch.Generator):
        batch = sample_batch(data, a.batch, width, g, starts, top_starts, a.top_level_fraction)
        if generated is not None:
            batch[a.batch - n_gen:] = sample_generated(generated, n_gen, width, g)
        loss, recall = cen.centroid_loss(asst, tgt, batch, a.seq_len, a.depth, a.queries or None, g)
        return loss, {"ce": loss.item(), "recall": recall}

    return loop.Stage(
        model=asst, columns=("ce", "recall"), step=step,
        evaluate=lambda: assistant.evaluate(asst, tgt, val, a.seq_len, a.depth, a.batch),
        export=lambda d: assistant_io.export_checkpoint(asst, tkw, assistant.SIZES[size], tgt, d, DTYPES[a.dtype]),
        tokens_per_step=a.batch * (a.queries or a.seq_len - 1),
        summary={"stage": "centroids", "num_centroids": a.num_centroids, "top_k": a.top_k},
        describe=f"centroids: {a.num_centroids} x {asst.cfg.vocab_size // a.num_centroids} tokens, top {a.top_k}, "
                 f"on {a.init_from}")


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


STAGES = {"target": (TargetArgs, target_stage), "assistant": (AssistantArgs, assistant_stage),
          "centroids": (CentroidArgs, centroid_stage)}


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
