"""Load a Hugging Face Qwen3-Next checkpoint (model.safetensors, or a sharded index) into the
model, by the checkpoint's own names.

Every check runs on the safetensors headers first (names and shapes, no data read), and every
missing, unexpected or misshapen weight is reported in one `CheckpointError` (every rank checks
the whole checkpoint, so all ranks agree on it). Each tensor-parallel rank then reads only the
slices its parameters hold: tensors are opened lazily (`Stored`) and read by `.narrow`.
"""

import dataclasses
import json
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from ..errors import CheckpointError
from .layers import Linear
from .qwen3_next import GatedDeltaNet, Qwen3NextForCausalLM


@dataclasses.dataclass
class WeightSpec:
    param: torch.nn.Parameter
    sources: dict[str, tuple[int, ...]]           # checkpoint name -> expected full shape
    assemble: Callable[[dict], torch.Tensor]  # full (Stored) tensors -> this rank's param


class Stored:
    """A checkpoint tensor not read yet. `.narrow` reads just that slice from the file (what a
    tensor-parallel rank needs); `.read()` the whole tensor."""

    def __init__(self, sl):
        self._sl, self.shape = sl, torch.Size(sl.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        idx = [slice(None)] * len(self.shape)
        idx[dim] = slice(start, start + length)
        return self._sl[tuple(idx)]

    def read(self) -> torch.Tensor:
        return self._sl[:]


def _tensor(x) -> torch.Tensor:
    return x.read() if isinstance(x, Stored) else x


def checkpoint_index(path: Path) -> dict[str, Path]:
    """checkpoint tensor name -> safetensors file holding it."""
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / fname for name, fname in weight_map.items()}
    if single.exists():
        with safe_open(single, "pt") as f:
            return {name: single for name in f.keys()}
    raise CheckpointError(f"{path} holds neither model.safetensors nor model.safetensors.index.json")


def has_mtp_weights(path: Path) -> bool:
    return any(n.startswith("mtp.") for n in checkpoint_index(path))


def _shapes(index: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    shapes, by_file = {}, {}
    for name, f in index.items():
        by_file.setdefault(f, []).append(name)
    for f, names in by_file.items():
        if not f.exists():
            raise CheckpointError(f"the index names {f.name}, which is not in the checkpoint directory")
        with safe_open(f, "pt") as fh:
            present = set(fh.keys())
            for n in names:
                if n not in present:
                    raise CheckpointError(f"the index maps {n} to {f.name}, which does not contain it")
                shapes[n] = tuple(fh.get_slice(n).get_shape())
    return shapes


def _param_specs(model: Qwen3NextForCausalLM) -> list[WeightSpec]:
    cfg, tp = model.cfg, model.tp
    modules = dict(model.named_modules())
    specs: list[WeightSpec] = []
    V, H = cfg.vocab_size, cfg.hidden_size
    # Vocab-parallel: rank r holds rows r*ceil(V/size) ... (zero-padded past V).
    specs.append(WeightSpec(model.embed_tokens, {"model.embed_tokens.weight": (V, H)},
                            lambda t: tp.shard_padded(next(iter(t.values())), 0)))
    if model.lm_head is not None:
        specs.append(WeightSpec(model.lm_head, {"lm_head.weight": (V, H)},
                                lambda t: tp.shard_padded(next(iter(t.values())), 0)))
    for pname, p in model.named_parameters():
        if pname in ("embed_tokens", "lm_head"):
            continue
        owner_name, _, leaf = pname.rpartition(".")
        owner = modules[owner_name]
        ck = pname if pname.startswith("mtp.") else "model." + pname
        ck_owner = ck.rpartition(".")[0]
        if isinstance(owner, Linear):
            specs.append(WeightSpec(p, {ck: owner.full_shape}, lambda t, m=owner: m.load_full(next(iter(t.values())))))
        elif leaf == "conv_weight":
            specs.append(_conv_spec(owner, p, ck_owner, cfg, tp))
        elif leaf in ("A_log", "dt_bias"):
            specs.append(WeightSpec(p, {ck: (cfg.linear_num_value_heads,)},
                                    lambda t: tp.shard(next(iter(t.values())), 0)))
        elif leaf in ("w13", "w2"):
            specs.append(_expert_spec(p, leaf, ck_owner, cfg, tp))
        else:  # norms: replicated, same shape everywhere
            specs.append(WeightSpec(p, {ck: tuple(p.shape)}, lambda t: next(iter(t.values()))))
    return specs


def _conv_spec(owner: GatedDeltaNet, p, prefix: str, cfg, tp) -> WeightSpec:
    # Channels are [q (Dk) | k (Dk) | v (Dv)]: each segment is sharded on its own.
    def assemble(t):
        w, parts, start = next(iter(t.values())), [], 0
        for seg in (cfg.key_dim, cfg.key_dim, cfg.value_dim):
            part = seg // tp.size
            parts.append(w.narrow(0, start + tp.rank * part, part))
            start += seg
        return torch.cat(parts, dim=0).squeeze(1)

    return WeightSpec(p, {prefix + ".conv1d.weight": (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim)}, assemble)


def _expert_spec(p, leaf: str, prefix: str, cfg, tp) -> WeightSpec:
    # Every expert is checked; only this rank's experts (see SparseMoE) are read.
    E, H, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    ex, n = prefix + ".experts", E // tp.size
    mine = range(tp.rank * n, (tp.rank + 1) * n)
    if leaf == "w13":
        names = {f"{ex}.{e}.{w}.weight": (inter, H) for e in range(E) for w in ("gate_proj", "up_proj")}

        def assemble(t):
            return torch.stack([torch.cat([_tensor(t[f"{ex}.{e}.gate_proj.weight"]),
                                           _tensor(t[f"{ex}.{e}.up_proj.weight"])]) for e in mine])
    else:
        names = {f"{ex}.{e}.down_proj.weight": (H, inter) for e in range(E)}

        def assemble(t):
            return torch.stack([_tensor(t[f"{ex}.{e}.down_proj.weight"]) for e in mine])
    return WeightSpec(p, names, assemble)


def _fused_expert_aliases(shapes: dict, cfg) -> dict[str, tuple[str, Callable]]:
    """Checkpoints written with experts already fused (experts.gate_up_proj [E, 2I, H],
    experts.down_proj [E, H, I]) are read as if split per expert."""
    aliases = {}
    for name in shapes:
        if name.endswith(".experts.gate_up_proj"):
            ex, I = name[: -len(".gate_up_proj")], cfg.moe_intermediate_size
            for e in range(cfg.num_experts):
                aliases[f"{ex}.{e}.gate_proj.weight"] = (name, lambda t, e=e: t[e, :I])
                aliases[f"{ex}.{e}.up_proj.weight"] = (name, lambda t, e=e: t[e, I:])
        elif name.endswith(".experts.down_proj"):
            ex = name[: -len(".down_proj")]
            for e in range(cfg.num_experts):
                aliases[f"{ex}.{e}.down_proj.weight"] = (name, lambda t, e=e: t[e])
    return aliases


def load_checkpoint(model: Qwen3NextForCausalLM, path: str | Path, dtype: torch.dtype,
                    device: torch.device) -> None:
    """Check every name and shape, then load every parameter as `dtype` on `device`."""
    path = Path(path)
    index = checkpoint_index(path)
    shapes = _shapes(index)
    aliases = _fused_expert_aliases(shapes, model.cfg)
    specs = _param_specs(model)
    expected = {n: s for spec in specs for n, s in spec.sources.items()}

    def found_shape(n):
        if n in shapes:
            return shapes[n]
        src, fn = aliases[n]
        return tuple(fn(torch.empty(shapes[src], device="meta")).shape)

    used_fused = {aliases[n][0] for n in expected if n not in shapes and n in aliases}
    missing = [n for n in expected if n not in shapes and n not in aliases]
    misshapen = [(n, expected[n], found_shape(n)) for n in expected
                 if n not in missing and found_shape(n) != tuple(expected[n])]
    ignorable = ("mtp.",) if model.mtp is None else ()
    unexpected = [n for n in shapes if n not in expected and n not in used_fused
                  and not n.startswith(ignorable)]
    if missing or misshapen or unexpected:
        lines = [f"checkpoint {path} does not match the model config:"]
        lines += [f"  missing: {n} (expected shape {list(expected[n])})" for n in missing]
        lines += [f"  misshapen: {n} expected {list(e)} found {list(f)}" for n, e, f in misshapen]
        lines += [f"  unexpected: {n} (shape {list(shapes[n])})" for n in unexpected]
        raise CheckpointError("\n".join(lines))

    handles: dict[Path, object] = {}
    cache: dict[str, torch.Tensor] = {}

    def read(n):  # nothing is read from the file until a spec narrows or reads it
        if n in shapes:
            f = index[n]
            if f not in handles:
                handles[f] = safe_open(f, "pt")
            return Stored(handles[f].get_slice(n))
        src, fn = aliases[n]
        if src not in cache:
            cache[src] = _tensor(read(src))
        return fn(cache[src])

    with torch.no_grad():
        for spec in specs:
            value = _tensor(spec.assemble({n: read(n) for n in spec.sources}))
            spec.param.data = value.to(dtype=dtype, device=device).contiguous()
    handles.clear()
    for buf in model.buffers():  # RoPE frequencies stay fp32
        buf.data = buf.data.to(device)
