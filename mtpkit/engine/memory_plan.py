"""A memory budget and what takes it, as serving engines count them.

The budget is what the engine may use on its device: `memory_budget` bytes, or on CUDA
`gpu_memory_utilization` x the device's memory less what others already hold there. From it
come, in order: the weights (computed before any is read: the model built on the meta device,
every parameter at its rank's shape and its loaded dtype, kept FP8 weights at one byte each
plus their fp32 scales and row indices), the activations of the largest step (estimated from the config first; on
CUDA then measured by a profile run: a prefill of max_num_batched_tokens tokens), and the
caches, sized from what is left by engine/pool_sizing.py (plan_pools): the state pool slots for
max_num_seqs requests (`bundle` each, the null slot), the sliding-window KV pools at the sizes
their windows bound, the prefix cache's state snapshots (a state slot's bytes each; models with
recurrent state), the full-attention KV pool every byte left, at least one request at
max_model_len (shorter requests share it). The generation controls' tables (a row of
counts, flags and biases per running request and vocabulary entry) are reserved before the caches:
they are allocated at the first step that uses a control.
Too little for one request is a ConfigError with the numbers, raised before any weight is
read. CUDA-graph memory is not measured (graphs are captured lazily, after the plan).
"""

import dataclasses

import torch

from mtpkit.errors import ConfigError

GiB = 1 << 30


def gib(n: int) -> str:
    """A byte count for people: GiB, MiB or bytes."""
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / (1 << 20):.1f} MiB" if abs(n) >= 1 << 20 else f"{n} B"


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    budget: int
    weight_bytes: int
    activation_bytes: int
    activation_source: str          # "estimated" or "measured"
    num_blocks: int                 # the full-attention pool's, null block included
    num_slots: int | None           # null slot included; None: the model keeps no state
    bytes_per_block: int            # of the full-attention pool
    bytes_per_slot: int
    max_concurrent: int             # requests at max_model_len the pools hold at once
    max_model_len: int
    sliding_bytes: int = 0          # the sliding-window pools, sized by their windows
    sliding_blocks: dict = dataclasses.field(default_factory=dict)   # pool name -> blocks
    num_snapshots: int = 0          # the prefix cache's state snapshots (bytes_per_slot each)
    control_bytes: int = 0          # the generation controls' tables (sampling/controls.py ControlTables)

    @property
    def cache_bytes(self) -> int:
        return (self.num_blocks * self.bytes_per_block + self.sliding_bytes
                + ((self.num_slots or 0) + self.num_snapshots) * self.bytes_per_slot)

    def summary(self) -> str:
        state = (f", {self.num_slots} state slots ({gib(self.num_slots * self.bytes_per_slot)})"
                 if self.num_slots is not None else "")
        sliding = "".join(f", {n} {name} blocks" for name, n in self.sliding_blocks.items())
        sliding += f" ({gib(self.sliding_bytes)})" if self.sliding_blocks else ""
        if self.num_snapshots:
            state += (f", {self.num_snapshots} prefix-cache state snapshots of {gib(self.bytes_per_slot)} "
                      f"({gib(self.num_snapshots * self.bytes_per_slot)})")
        controls = f" + generation controls' tables {gib(self.control_bytes)}" if self.control_bytes else ""
        return (f"mtpkit memory plan: budget {gib(self.budget)} = weights {gib(self.weight_bytes)} + "
                f"activations {gib(self.activation_bytes)} ({self.activation_source}){controls} + caches "
                f"{gib(self.cache_bytes)}: {self.num_blocks} KV blocks "
                f"({gib(self.num_blocks * self.bytes_per_block)}){sliding}{state}; at most {self.max_concurrent} "
                f"concurrent requests at max_model_len={self.max_model_len}")


def budget_of(device: torch.device, memory_budget: int | None, gpu_memory_utilization: float | None,
              **explicit) -> tuple[int, str] | None:
    """(bytes the engine may use, how the budget was given), None when no budget is given.
    `explicit`: the other ways to size the pools, which a budget replaces."""
    if memory_budget is None and gpu_memory_utilization is None:
        return None
    if memory_budget is not None and gpu_memory_utilization is not None:
        raise ConfigError("give either gpu_memory_utilization or memory_budget, not both")
    given = [f"{n}={v}" for n, v in explicit.items() if v is not None]
    if given:
        raise ConfigError(f"{', '.join(given)} and a memory budget both size the caches: give one of them")
    if memory_budget is not None:
        if memory_budget < 1:
            raise ConfigError(f"memory_budget={memory_budget} must be a positive number of bytes")
        return memory_budget, f"memory_budget={memory_budget}"
    u = gpu_memory_utilization
    if not isinstance(u, (int, float)) or isinstance(u, bool) or not 0 < u <= 1:
        raise ConfigError(f"gpu_memory_utilization={u!r} must be a number in (0, 1]")
    if device.type != "cuda":
        raise ConfigError(f"gpu_memory_utilization needs a CUDA device (device is {device}); on CPU give "
                          "memory_budget=<bytes> (weights, activations and caches)")
    free, total = torch.cuda.mem_get_info(device)
    used = total - free  # other processes, and this one's CUDA context
    return int(u * total) - used, (f"gpu_memory_utilization={u} ({gib(int(u * total))} of {gib(total)}, "
                                   f"less {gib(used)} already in use on {device})")


def meta_model(family, cfg, *, path, load_format: str, device: torch.device, attn_backend, tp,
               keep_fp8: bool | None = None, **kwargs) -> torch.nn.Module:
    """The model with every parameter on the meta device (shapes and dtypes, no memory), its
    modules in FP8 mode where the loader will keep FP8 weights (FP8 checkpoints; `keep_fp8`
    as the loader's: default on CUDA; from config.json and the headers)."""
    from mtpkit.kernels.ops import select_ops
    from mtpkit.checkpoint.loader import fp8_weights, keep_fp8_linears
    keep = device.type == "cuda" if keep_fp8 is None else keep_fp8
    fp8 = fp8_weights(path) if load_format == "safetensors" and keep else None
    with torch.device("meta"):
        model = family.model_class(cfg, select_ops(device, attn_backend), tp, **kwargs)
        if fp8 is not None:
            keep_fp8_linears(model, *fp8)
    return model


def meta_models(family, cfg, draft, *, path, **kwargs) -> list[torch.nn.Module]:
    """The target (with what its drafter needs of it) and, for a drafter with its own model,
    that model too: every model whose weights the device will hold, on the meta device.
    `kwargs`: meta_model's, then the target's own keyword arguments."""
    target_kwargs = draft.target_kwargs if draft else {}
    models = [meta_model(family, cfg, path=path, **kwargs, **target_kwargs)]

    def load(d_family, d_cfg, d_path, **kw):
        models.append(meta_model(d_family, d_cfg, path=d_path, **kwargs, **kw))
        return models[-1]
    if draft is not None:
        draft.build(models[0], load=load)
    return models


def weight_bytes(models: torch.nn.Module | list[torch.nn.Module], dtype: torch.dtype) -> int:
    """Bytes of the models' parameters once loaded: `dtype`, except what is kept as stored
    (FP8 weights and their fp32 scales); buffers (RoPE tables) in fp32."""
    total = 0
    for model in models if isinstance(models, list) else [models]:
        for p in model.parameters():
            kept = p.dtype == torch.float8_e4m3fn or getattr(p, "fp8_scale", False)
            total += p.numel() * (p.dtype.itemsize if kept else dtype.itemsize)
        total += sum(b.numel() * b.dtype.itemsize for b in model.buffers())
    return total


def activation_estimate(model: torch.nn.Module, *, tokens: int, logits_rows: int, vocab: int,
                        dtype: torch.dtype) -> int:
    """An upper estimate of a step's activations before a profile run can measure them: a
    few live tensors of the widest projection's output per token (MoE: every local expert's
    gate and up rows, the dense path), plus fp32 logits and their softmax."""
    widest = 0
    for p in model.parameters():
        if p.dim() == 2:
            widest = max(widest, p.shape[0] if p.shape[0] != vocab else 0)
        elif p.dim() == 3 and not getattr(p, "expert_down", False):   # [local experts, 2I, hidden]
            widest = max(widest, p.shape[0] * p.shape[1])
    return 4 * tokens * widest * dtype.itemsize + 2 * logits_rows * vocab * 4
