"""The "triton" backend `TRITON`: every Ops field of the table in ops.py run by its Triton
kernel (triton_paged, triton_conv, triton_gdn, triton_moe, triton_elementwise,
triton_fp8_matmul; flash-attn inside triton_paged where importable and applicable, fla-core's
chunked kernel for GDN prefill where importable), with write_kv from the torch reference.
Each entry point falls back to its reference only by triton_common.use_reference's rule.

Importing this module registers the backend; `select_ops` imports it lazily when
"triton" is asked for or the device is CUDA. On CPU it runs only under the Triton
interpreter (TRITON_INTERPRET=1 set before this module is imported), which is how the
tests use it; the factory refuses otherwise, with a message naming the torch backend.
"""

import torch

from mtpkit.errors import ConfigError
from mtpkit.kernels.ops import Ops, register_ops
from mtpkit.kernels import triton_conv, triton_elementwise, triton_fp8_matmul, triton_gdn, triton_moe, triton_paged

__all__ = ["TRITON", "make_triton_ops"]

TRITON = Ops(
    name="triton",
    write_kv=triton_paged.write_kv,
    paged_attention_prefill=triton_paged.paged_attention_prefill,
    paged_attention_verify=triton_paged.paged_attention_verify,
    verify_gather=None,  # the kernel reads through the block table
    causal_conv1d_prefill=triton_conv.causal_conv1d_prefill,
    causal_conv1d_verify=triton_conv.causal_conv1d_verify,
    gated_delta_rule_prefill=triton_gdn.gated_delta_rule_prefill,
    gated_delta_rule_verify=triton_gdn.gated_delta_rule_verify,
    causal_conv1d_prefill_rows=None,    # a captured prefill is a CPU trace of the torch backend
    gated_delta_rule_prefill_rows=None,
    moe_experts=triton_moe.moe_experts,
    fused_moe=True,
    rms_norm=triton_elementwise.rms_norm,
    add_rms_norm=triton_elementwise.add_rms_norm,
    norm_add_rms_norm=triton_elementwise.norm_add_rms_norm,
    norm_add=triton_elementwise.norm_add,
    gated_rms_norm=triton_elementwise.gated_rms_norm,
    act_mul=triton_elementwise.act_mul,
    fp8_linear=triton_fp8_matmul.fp8_linear,
    fp8_batched=triton_fp8_matmul.fp8_batched,
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
