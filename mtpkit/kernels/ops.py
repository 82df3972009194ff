"""`Ops`: the one selector of every kernel a model runs, and the torch backend `TORCH`.

A model is built with one `Ops` (called `ops` in every model and layer) and runs every kernel
through it: attention, GDN, conv, the MoE experts, the elementwise glue and the block-scaled
FP8 matmuls. Nothing else picks a kernel: no layer looks at the device or imports a Triton
module. `select_ops` picks the backend by device (CUDA: "triton" when Triton imports, else
"torch"), unless `LLM(attn_backend="torch" | "triton")` or MTPKIT_ATTN_BACKEND (for debugging)
says otherwise. The user-facing name `attn_backend` is historical: it selects EVERY kernel
below, not only attention's. A layer built without `ops` (unit tests) runs the torch
references.

Each field, its torch reference (the "torch" backend, which is also the CPU path) and its
Triton kernel (the "triton" backend, `triton_ops.TRITON`), same names, signatures and
semantics; every Triton module `triton_X.py` sits beside its reference `X.py` and is tested
against it:

  field                     torch reference (kernels/)          Triton kernel (kernels/)
  ------------------------  ----------------------------------  -----------------------------------
  write_kv                  paged.write_kv                      the same (triton_paged.write_kv)
  paged_attention_prefill   paged.paged_attention_prefill       triton_paged (flash-attn if usable)
  paged_attention_verify    paged.paged_attention_verify        triton_paged (flash-attn if usable)
  verify_gather             paged.verify_gather                 None: the kernel walks the table
  causal_conv1d_prefill     conv.causal_conv1d_prefill          triton_conv
  causal_conv1d_verify      conv.causal_conv1d_verify           triton_conv
  gated_delta_rule_prefill  gdn.gated_delta_rule_prefill        triton_gdn (fla-core if importable)
  gated_delta_rule_verify   gdn.gated_delta_rule_verify         triton_gdn
  causal_conv1d_prefill_rows     conv.causal_conv1d_prefill_rows   None: CPU traces only (below)
  gated_delta_rule_prefill_rows  gdn.gated_delta_rule_prefill_rows None: CPU traces only (below)
  moe_experts               moe_experts.moe_experts             triton_moe.moe_experts (fused)
  fused_moe                 False                               True
  rms_norm, add_rms_norm,   elementwise.<same name>             triton_elementwise.<same name>
  norm_add_rms_norm,
  norm_add, gated_rms_norm,
  act_mul
  fp8_linear                fp8_matmul.fp8_linear               triton_fp8_matmul.fp8_linear
  fp8_batched               fp8_matmul.fp8_batched              triton_fp8_matmul.fp8_batched

The two `_rows` fields run a captured CPU prefill (step.metadata.PrefillRows: chunks padded to one
length, traced like a decode step); only the torch backend is traced, so Triton has none.

A Triton entry point runs its torch reference only by the one rule of
`triton_common.use_reference` (fp64 inputs); choosing flash-attn or fla-core inside the Triton
backend picks among GPU kernels and never reaches the reference.
"""

import dataclasses
import os
import warnings
from typing import Callable

import torch

from mtpkit.errors import ConfigError
from mtpkit.kernels import conv, elementwise, fp8_matmul, gdn, moe_experts, paged


@dataclasses.dataclass(frozen=True)
class Ops:
    """One backend's kernels (the table in the module docstring). Every field is given."""
    name: str
    write_kv: Callable
    paged_attention_prefill: Callable
    paged_attention_verify: Callable
    # The KV slots a uniform step's attention gathers (paged.verify_gather), when the backend's
    # paged_attention_verify reads them (`kv_slots`, `kv_pos`): the same for every layer of a KV
    # pool, so a model computes them once per step. None: the kernel walks the block table.
    verify_gather: Callable | None
    causal_conv1d_prefill: Callable
    causal_conv1d_verify: Callable
    gated_delta_rule_prefill: Callable
    gated_delta_rule_verify: Callable
    # A prefill over chunks padded at their ends to one length (a traced CPU prefill); None: the
    # backend is never traced (graphs/captured.py traces only the torch backend).
    causal_conv1d_prefill_rows: Callable | None
    gated_delta_rule_prefill_rows: Callable | None
    # The routed experts of a fixed-shape MoE step (SparseMoE's sparse path, 16-bit or fp32
    # weights; FP8 experts run fp8_batched).
    moe_experts: Callable
    # moe_experts reads each touched expert once per call, however many tokens chose it (a fused
    # kernel): SparseMoE then gathers at every captured step size instead of computing every expert.
    fused_moe: bool
    # The elementwise glue of the decoder layers (kernels/elementwise.py: norms fused with the
    # residual add, GDN's gated norm, gated activations): one fused kernel each on Triton.
    rms_norm: Callable
    add_rms_norm: Callable
    norm_add_rms_norm: Callable
    norm_add: Callable
    gated_rms_norm: Callable
    act_mul: Callable
    # The block-scaled FP8 matmuls of weights kept in FP8 (layers/fp8_layout.FP8Matrix):
    # x @ W^T with any leading dims of x, and a batch of products over a stack of weights
    # (the MoE's experts), the activation quantized per token and group inside.
    fp8_linear: Callable
    fp8_batched: Callable


TORCH = Ops(
    name="torch",
    write_kv=paged.write_kv,
    paged_attention_prefill=paged.paged_attention_prefill,
    paged_attention_verify=paged.paged_attention_verify,
    verify_gather=paged.verify_gather,
    causal_conv1d_prefill=conv.causal_conv1d_prefill,
    causal_conv1d_verify=conv.causal_conv1d_verify,
    gated_delta_rule_prefill=gdn.gated_delta_rule_prefill,
    gated_delta_rule_verify=gdn.gated_delta_rule_verify,
    causal_conv1d_prefill_rows=conv.causal_conv1d_prefill_rows,
    gated_delta_rule_prefill_rows=gdn.gated_delta_rule_prefill_rows,
    moe_experts=moe_experts.moe_experts,
    fused_moe=False,
    rms_norm=elementwise.rms_norm,
    add_rms_norm=elementwise.add_rms_norm,
    norm_add_rms_norm=elementwise.norm_add_rms_norm,
    norm_add=elementwise.norm_add,
    gated_rms_norm=elementwise.gated_rms_norm,
    act_mul=elementwise.act_mul,
    fp8_linear=fp8_matmul.fp8_linear,
    fp8_batched=fp8_matmul.fp8_batched,
)

_REGISTRY: dict[str, Callable[[], Ops]] = {"torch": lambda: TORCH}


def register_ops(name: str, factory: Callable[[], Ops]) -> None:
    """Make a backend selectable by name (triton_ops.py registers "triton" when imported)."""
    _REGISTRY[name] = factory


def select_ops(device: torch.device, override: str | None = None) -> Ops:
    """The backend of every kernel: `override` (LLM's attn_backend), else MTPKIT_ATTN_BACKEND,
    else "triton" on CUDA when Triton imports (a warning when it does not) and "torch" elsewhere."""
    name = override or os.environ.get("MTPKIT_ATTN_BACKEND") or None
    if "triton" not in _REGISTRY and (name == "triton" or (name is None and device.type == "cuda")):
        try:  # registers itself; imported lazily so that CPU runs never import Triton
            from mtpkit.kernels import triton_ops as triton_backend  # noqa: F401
        except ImportError as e:
            missing = isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] == "triton"
            why = ('Triton is not installed (it is an optional dependency): pip install "mtpkit[gpu]"'
                   if missing else f"it cannot be imported: {e}")
            if name == "triton":
                raise ConfigError(f"attention backend 'triton': {why}; or use attn_backend='torch'") from e
            warnings.warn(f"the Triton backend is not used on {device} because {why}; running the torch "
                          "reference kernels (much slower)", RuntimeWarning, stacklevel=2)
    if name is None:
        name = "triton" if device.type == "cuda" and "triton" in _REGISTRY else "torch"
    if name not in _REGISTRY:
        raise ConfigError(f"attention backend {name!r} is not available; choose from {sorted(_REGISTRY)}")
    return _REGISTRY[name]()
