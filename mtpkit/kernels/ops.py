"""Which implementation of each attention-side op a model uses.

The torch functions in gdn.py / conv.py / paged.py are the references (and the CPU path).
GPU kernels register themselves here under another name; `select_ops` picks by device
unless overridden (`LLM(..., attn_backend="torch")`, or MTPKIT_ATTN_BACKEND for debugging).
"""

import dataclasses
import os
import warnings
from typing import Callable

import torch

from mtpkit.errors import ConfigError
from mtpkit.kernels import elementwise as glue_ref
from mtpkit.kernels import moe_experts as moe_ref
from mtpkit.kernels import conv, gdn, paged


@dataclasses.dataclass(frozen=True)
class Ops:
    name: str
    write_kv: Callable
    paged_attention_prefill: Callable
    paged_attention_verify: Callable
    causal_conv1d_prefill: Callable
    causal_conv1d_verify: Callable
    gated_delta_rule_prefill: Callable
    gated_delta_rule_verify: Callable
    # The routed experts of a fixed-shape MoE step (SparseMoE's sparse path): not attention,
    # but chosen with the same backend (a fused Triton kernel on GPU).
    moe_experts: Callable = moe_ref.moe_experts
    # moe_experts reads each touched expert once per call, however many tokens chose it (a fused
    # kernel): SparseMoE then gathers at every captured step size instead of computing every expert.
    fused_moe: bool = False
    # The KV slots a uniform step's attention gathers (paged.verify_gather), when the backend's
    # paged_attention_verify reads them (`kv_slots`, `kv_pos`): the same for every layer of a KV
    # pool, so a model computes them once per step. None: the kernel walks the block table.
    verify_gather: Callable | None = None
    # The elementwise glue of the decoder layers (kernels/elementwise.py: norms fused with the
    # residual add, GDN's gated norm, gated activations): one fused kernel each on Triton.
    rms_norm: Callable = glue_ref.rms_norm
    add_rms_norm: Callable = glue_ref.add_rms_norm
    norm_add_rms_norm: Callable = glue_ref.norm_add_rms_norm
    norm_add: Callable = glue_ref.norm_add
    gated_rms_norm: Callable = glue_ref.gated_rms_norm
    act_mul: Callable = glue_ref.act_mul


TORCH = Ops(
    name="torch",
    write_kv=paged.write_kv,
    paged_attention_prefill=paged.paged_attention_prefill,
    paged_attention_verify=paged.paged_attention_verify,
    causal_conv1d_prefill=conv.causal_conv1d_prefill,
    causal_conv1d_verify=conv.causal_conv1d_verify,
    gated_delta_rule_prefill=gdn.gated_delta_rule_prefill,
    gated_delta_rule_verify=gdn.gated_delta_rule_verify,
    verify_gather=paged.verify_gather,
)

_REGISTRY: dict[str, Callable[[], Ops]] = {"torch": lambda: TORCH}


def register_ops(name: str, factory: Callable[[], Ops]) -> None:
    _REGISTRY[name] = factory


def select_ops(device: torch.device, override: str | None = None) -> Ops:
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
