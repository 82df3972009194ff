"""The training loop every embedded model's stages share (training.train: tiny-qwen3-next;
training.gemma4_train: tiny-gemma4 and its assistant).

AdamW (betas 0.9/0.95, weight decay on matrices only), linear warm-up then cosine decay to
`min_lr_ratio * lr`, gradient clipping; one line per step in `loss.tsv`, a held-out
evaluation every `eval_every` steps (`eval.tsv`, one JSON object a line), the training state
every `save_every` steps (`train_state.pt`: model, optimiser, the batch RNG, step, elapsed
time and the run's arguments), intermediate exports to `work_dir/export`, and at the end the
checkpoint in `out_dir`, `work_dir/export` and `summary.json`. Rerunning the same command
resumes from `train_state.pt`; other arguments are refused (the state would not be theirs).

A stage plugs in as a `Stage`: its model (the trainable parameters are those with
requires_grad), a step function drawing its batch from the loop's generator and returning
the loss to minimise with the values logged beside it, an evaluation and an export.
"""

import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn


@dataclasses.dataclass
class Stage:
    model: nn.Module
    columns: tuple[str, ...]      # loss.tsv columns between `loss` and `grad_norm`, in order
    # step(step index, batch generator) -> (loss to minimise, {column: value})
    step: Callable[[int, torch.Generator], tuple[torch.Tensor, dict[str, float]]]
    evaluate: Callable[[], dict]  # held-out metrics (called in eval mode, without gradients)
    export: Callable[[Path], Path]
    tokens_per_step: int
    summary: dict = dataclasses.field(default_factory=dict)   # extra fields of summary.json
    describe: str = ""            # logged once before the first step
    close: Callable[[], object] = lambda: None   # called when the run ends (e.g. removes hooks)


def lr_at(step: int, a) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * lr at the last step."""
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    t = (step - a.warmup) / max(a.steps - a.warmup, 1)
    return a.lr * (a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def make_optimizer(model: nn.Module, a) -> torch.optim.AdamW:
    """AdamW over the parameters that require grad; weight decay on matrices (and stacked
    experts), none on vectors (norms, scalars, A_log, dt_bias) or the GDN conv."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 and not name.endswith("conv_weight") else no_decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=a.lr, betas=(0.9, 0.95), eps=1e-8)


def save_state(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def run(stage: Stage, a, log=print) -> nn.Module:
    """Train `stage` for a.steps steps (resuming from a.work_dir when a state is there).
    `a` is the stage's argument dataclass; the loop reads steps, lr, warmup, min_lr_ratio,
    weight_decay, clip, seed, work_dir, out_dir, save_every, eval_every, export_every."""
    try:
        return _run(stage, a, log)
    finally:
        stage.close()


def _run(stage: Stage, a, log) -> nn.Module:
    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    model, args = stage.model, dataclasses.asdict(a)
    opt = make_optimizer(model, a)
    g = torch.Generator().manual_seed(a.seed)
    step, elapsed_before, cpu_before = 0, 0.0, 0.0
    state_path = work / "train_state.pt"
    if state_path.exists():
        st = torch.load(state_path, weights_only=False)
        if st["args"] != args:
            raise SystemExit(f"{state_path} was written with other arguments; remove it or use "
                             f"another --work-dir\n  saved: {st['args']}\n  now:   {args}")
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        g.set_state(st["rng"])
        step, elapsed_before, cpu_before = st["step"], st["elapsed"], st.get("cpu", 0.0)
        log(f"resumed from {state_path} at step {step}")
    (work / "args.json").write_text(json.dumps(args, indent=2))
    if stage.describe:
        log(stage.describe)
    loss_log = (work / "loss.tsv").open("a")
    if step == 0:
        loss_log.write("step\ttokens\tlr\tloss\t" + "".join(f"{c}\t" for c in stage.columns) + "grad_norm\telapsed_s\n")
    # Wall time, and this process's CPU time (on a shared machine the better measure of what a
    # stage costs on one thread; both carry over a resume).
    t0, c0, tokens_per_step = time.time() - elapsed_before, time.process_time() - cpu_before, stage.tokens_per_step
    trainable = [p for p in model.parameters() if p.requires_grad]
    model.train()
    while step < a.steps:
        lr = lr_at(step, a)
        for group in opt.param_groups:
            group["lr"] = lr
        loss, cols = stage.step(step, g)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(trainable, a.clip)
        opt.step()
        step += 1
        elapsed = time.time() - t0
        values = [cols[c] for c in stage.columns]
        loss_log.write(f"{step}\t{step * tokens_per_step}\t{lr:.3e}\t{loss.item():.4f}\t"
                       + "".join(f"{v:.4f}\t" for v in values) + f"{float(gn):.3f}\t{elapsed:.1f}\n")
        loss_log.flush()
        if step % 10 == 0 or step == 1:
            shown = " ".join(f"{c} {v:.4f}" for c, v in zip(stage.columns, values) if not math.isnan(v))
            log(f"step {step}/{a.steps} loss {loss.item():.4f} {shown} lr {lr:.2e} gn {float(gn):.2f} "
                f"{step * tokens_per_step / elapsed:.0f} tok/s {elapsed / 60:.1f} min")
        if step % a.eval_every == 0 or step == a.steps:
            model.eval()
            with torch.no_grad():
                ev = stage.evaluate()
            model.train()
            log(f"eval step {step}: " + " ".join(f"{k} {v:.4f}" for k, v in ev.items()))
            with (work / "eval.tsv").open("a") as f:
                f.write(json.dumps({"step": step, "elapsed": elapsed, **ev}) + "\n")
        if step % a.save_every == 0 or step == a.steps:
            save_state(state_path, {"model": model.state_dict(), "opt": opt.state_dict(), "rng": g.get_state(),
                                    "step": step, "elapsed": time.time() - t0, "cpu": time.process_time() - c0,
                                    "args": args})
        if step % a.export_every == 0 and step < a.steps:
            try:  # an intermediate export is a convenience: never let it stop the run
                stage.export(work / "export")
                log(f"exported step {step} to {work / 'export'}")
            except Exception as e:  # noqa: BLE001 (an export failure must not stop training)
                log(f"export at step {step} failed ({type(e).__name__}: {e}); training goes on")
    loss_log.close()
    total, cpu = time.time() - t0, time.process_time() - c0
    log(f"trained {a.steps} steps, {a.steps * tokens_per_step:,} tokens in {total / 60:.1f} min "
        f"({cpu / 60:.1f} min of CPU time)")
    stage.export(Path(a.out_dir))
    stage.export(work / "export")
    (work / "summary.json").write_text(json.dumps({
        **stage.summary, "steps": a.steps, "tokens": a.steps * tokens_per_step, "wall_s": total, "cpu_s": cpu,
        "python": sys.version.split()[0], "torch": torch.__version__}, indent=2))
    log(f"wrote {a.out_dir}")
    return model
