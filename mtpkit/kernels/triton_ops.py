"""The "triton" attention backend: the Triton kernels of triton_gdn / triton_conv /
triton_paged, the fused MoE experts of models/triton_moe and the fused elementwise glue of
models/triton_elementwise (flash-attn inside triton_paged where importable and applicable, fla-core's
chunked kernel for GDN prefill where importable), with write_kv from the torch reference.

Importing this module registers the backend; `select_ops` imports it lazily when
"triton" is asked for or the device is CUDA. On CPU it runs only under the Triton
interpreter (TRITON_INTERPRET=1 set before this module is imported), which is how the
tests use it; the factory refuses otherwise, with a message naming the torch backend.
"""

import torch

from mtpkit.errors import ConfigError
from mtpkit.kernels.ops import Ops, register_ops
from mtpkit.kernels import triton_elementwise, triton_moe
from mtpkit.kernels import triton_conv, triton_gdn, triton_paged

__all__ = ["TRITON", "make_triton_ops"]

TRITON = Ops(
    name="triton",
    write_kv=triton_paged.write_kv,
    paged_attention_prefill=triton_paged.paged_attention_prefill,
    paged_attention_verify=triton_paged.paged_attention_verify,
    causal_conv1d_prefill=triton_conv.causal_conv1d_prefill,
    causal_conv1d_verify=triton_conv.causal_conv1d_verify,
    gated_delta_rule_prefill=triton_gdn.gated_delta_rule_prefill,
    gated_delta_rule_verify=triton_gdn.gated_delta_rule_verify,
    moe_experts=triton_moe.moe_experts,
    fused_moe=True,
    rms_norm=triton_elementwise.rms_norm,
    add_rms_norm=triton_elementwise.add_rms_norm,
    norm_add_rms_norm=triton_elementwise.norm_add_rms_norm,
    norm_add=triton_elementwise.norm_add,
    gated_rms_norm=triton_elementwise.gated_rms_norm,
    act_mul=triton_elementwise.act_mul,
)


def _interpreted() -> bool:
    # Decided when the kernel modules were imported (triton.jit reads TRITON_INTERPRET then).
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(triton_gdn._gdn_verify_kernel, InterpretedFunction)


def make_triton_ops() -> Ops:
    if not torch.cuda.is_available() and not _interpreted():
        raise ConfigError("attention backend 'triton' needs a CUDA device (or, for testing on CPU, "
                          "TRITON_INTERPRET=1 set before mtpkit's Triton kernels are imported); "
                          "use attn_backend='torch'")
    return TRITON


register_ops("triton", make_triton_ops)
