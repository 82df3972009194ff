"""Hugging Face transformers oracle for Qwen3-Next (helper module, not a test file).

Later tests compare mtpkit against ``transformers.Qwen3NextForCausalLM`` (transformers 5.24)
on tiny random models. This module builds those models deterministically, writes checkpoints
(optionally sharded, optionally with random ``mtp.*`` weights under the real checkpoint names),
and runs the reference forward / greedy decode on CPU. It never imports mtpkit.

Numerics of the oracle in float64 (read from transformers 5.24 modeling_qwen3_next.py; see
``HF_FP64_NOTES``): a float64 model is *not* float64 end to end. The gated-delta-rule core
(chunked and recurrent), both RMSNorm variants, RoPE cos/sin, and the MoE router softmax/top-k run
in float32 and are cast back, so HF float64 logits carry float32-level rounding (~1e-7 relative).
Compare against it with tolerances of that order (e.g. atol ~1e-5 on O(1) logits), not 1e-12.
``generate`` additionally casts each step's logits to float32 before its argmax. For a float64
reference end to end use ``with exact_fp64():`` (HF's own source with the float32 casts turned into
float64; cached vs uncached then agree to ~1e-15) and ``hf_greedy_with_logits(..., method="loop")``.

Important environment fact: if the ``fla`` package (flash-linear-attention, ``fla-core``) is
importable, transformers silently routes the gated delta rule to fla's Triton kernels, which crash
on CPU ("0 active drivers"). :func:`force_torch_fallbacks` (called by every builder/loader here)
rebinds the module globals to the pure-torch reference functions.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "TINY_CONFIGS",
    "HF_FP64_NOTES",
    "force_torch_fallbacks",
    "exact_fp64",
    "tiny_config",
    "build_hf_model",
    "perturb_",
    "mtp_param_shapes",
    "make_mtp_state_dict",
    "save_checkpoint",
    "load_hf_model",
    "hf_logits",
    "hf_greedy",
    "hf_greedy_with_logits",
    "TieReport",
    "compare_greedy_tie_aware",
    "assert_greedy_matches",
    "check_greedy_against_hf",
    "random_prompts",
    "random_prompt",
    "PROMPT_LENGTHS",
    "single_thread",
    "param_count",
]

HF_FP64_NOTES = """\
transformers 5.24 Qwen3-Next, model converted to torch.float64, CPU, pure-torch fallbacks:
- GDN core (torch_chunk_gated_delta_rule and torch_recurrent_gated_delta_rule): q, k, v, beta and
  g are cast to float32 on entry; the L2 norm of q/k, the dk^-0.5 scale, the whole chunked /
  token-by-token recurrence run in float32; the output is cast back to float64. The returned
  (and cached) recurrent state is float32, and an initial_state is cast to float32.
- g = -A_log.float().exp() * softplus(a.float() + dt_bias): exp(A_log) is computed in float32,
  softplus in float64 (float32 + float64 promotes), product float64 (then float32 in the core).
  beta = sigmoid(b) in float64 (then float32 in the core).
- causal conv1d (prefill and single-token update) and the in/out projections: float64.
- Gated RMSNorm (linear_attn.norm): variance and rsqrt in float32, weight multiply in float64,
  silu(z) in float32, product promoted to float64.
- Qwen3NextRMSNorm (input/post-attention/final/q_norm/k_norm): entirely float32
  (x.float(), 1 + w.float()), cast back to float64.
- RoPE: inv_freq and cos/sin computed in float32, cast to float64.
- Attention: sdpa (the default) in float64. (The eager path would softmax in float32.)
- MoE router: softmax in float32, top-k on the float32 probabilities, renormalisation in float32,
  weights cast to float64. Experts, shared expert, its sigmoid gate, lm_head: float64.
- generate(): each step's logits are cast to float32 (`transformers.generation.utils`) before the argmax, and
  output_logits returns those float32 logits.
- Measured on TINY_CONFIGS (std 0.05): stock-HF float64 vs exact_fp64 logits differ by 4e-7..3e-6;
  HF float32 vs HF float64 by 4e-7..8e-6; HF cached vs uncached (float64) by 1e-7..8e-7; under
  exact_fp64 cached vs uncached by <3e-15.
- If `fla` is importable the GDN core is fla's Triton kernel (crashes on CPU); see
  force_torch_fallbacks().
"""

# --------------------------------------------------------------------------------------------
# Tiny configs
# --------------------------------------------------------------------------------------------

_BASE: dict[str, Any] = dict(
    # The reference's known-good tiny config.
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=4,
    full_attention_interval=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    partial_rotary_factor=0.25,
    rope_theta=10000.0,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    intermediate_size=64,  # only used by dense (mlp_only_layers) layers
    decoder_sparse_step=1,
    mlp_only_layers=[],
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    max_position_embeddings=4096,
)


def _cfg(**overrides: Any) -> dict[str, Any]:
    d = copy.deepcopy(_BASE)
    if "layer_types" in overrides:
        d.pop("full_attention_interval", None)
    d.update(overrides)
    return d


_F, _L = "full_attention", "linear_attention"

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    # Reference config: interval 4 -> [L, L, L, F]; GQA 2; GDN ratio 2; top-2 of 4, normalised;
    # partial rotary 0.25, head_dim 16.
    "base": _cfg(),
    # Explicit layer_types, MHA (GQA ratio 1), head_dim 8, rotary 0.5, GDN ratio 1,
    # top-1 of 6 without norm_topk_prob, hidden 32, vocab 128.
    "mha_hd8_top1": _cfg(
        vocab_size=128,
        hidden_size=32,
        layer_types=[_L, _F, _L, _F],
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        partial_rotary_factor=0.5,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        num_experts=6,
        num_experts_per_tok=1,
        norm_topk_prob=False,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        rope_theta=1e7,
    ),
    # 2 layers [L, F]; GQA ratio 4 (4 heads / 1 kv head), head_dim 32, rotary 0.25;
    # GDN ratio 4 (1 key head, 4 value heads), dk 16 != dv 8; top-3 of 8 with norm_topk_prob.
    "gqa4_hd32_top3": _cfg(
        hidden_size=48,
        layer_types=[_L, _F],
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        partial_rotary_factor=0.25,
        linear_num_key_heads=1,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=True,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=16,
    ),
    # Full attention first: [F, L, L, F]; GQA 2 (2 heads / 1 kv), rotary 0.5; GDN ratio 2 with
    # dk 8 != dv 16; top-2 of 5 without norm; layer 1 is a dense MLP (mlp_only_layers=[1]).
    "full_first_dense1": _cfg(
        layer_types=[_F, _L, _L, _F],
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        partial_rotary_factor=0.5,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=16,
        num_experts=5,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        mlp_only_layers=[1],
        intermediate_size=48,
    ),
    # 5 layers via full_attention_interval 4 -> [L, L, L, F, L] (ends on a GDN layer);
    # GQA 4 (8 heads / 2 kv), head_dim 8; GDN ratio 1 with 4 heads; top-2 of 8 normalised.
    "five_layer": _cfg(
        num_hidden_layers=5,
        full_attention_interval=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=8,
        partial_rotary_factor=0.25,
        linear_num_key_heads=4,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        rope_theta=1e6,
    ),
    # [L, F, L, F] with GQA 1 on 4 heads, head_dim 16, rotary 0.5; GDN ratio 2 (1 key / 2 value);
    # top-1 of 4 with norm_topk_prob (weight exactly 1); hidden 32.
    "alt_top1_norm": _cfg(
        hidden_size=32,
        layer_types=[_L, _F, _L, _F],
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        partial_rotary_factor=0.5,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=4,
        num_experts_per_tok=1,
        norm_topk_prob=True,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
    ),
}


def tiny_config(name_or_kwargs: str | dict[str, Any]):
    """A ``Qwen3NextConfig`` from a TINY_CONFIGS name or a kwargs dict (the dict is not mutated)."""
    from transformers import Qwen3NextConfig

    kw = TINY_CONFIGS[name_or_kwargs] if isinstance(name_or_kwargs, str) else name_or_kwargs
    return Qwen3NextConfig(**copy.deepcopy(kw))


# --------------------------------------------------------------------------------------------
# Pure-torch fallbacks
# --------------------------------------------------------------------------------------------

_FALLBACK_NAMES = (
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)


def force_torch_fallbacks() -> None:
    """Make transformers' Qwen3-Next use its pure-torch GDN/conv reference functions.

    transformers wraps these functions so that, when ``fla`` / ``causal_conv1d`` are importable,
    their kernels are used instead (Triton; unusable on CPU). The wrapper keeps the original in
    ``__wrapped__``; rebind the module globals (which ``Qwen3NextGatedDeltaNet.forward`` looks up
    at call time) to it. Idempotent.
    """
    import transformers.models.qwen3_next.modeling_qwen3_next as M

    for name in _FALLBACK_NAMES:
        f = getattr(M, name)
        while hasattr(f, "__wrapped__"):
            f = f.__wrapped__
        code = getattr(f, "__code__", None)
        if code is None or not code.co_filename.endswith("modeling_qwen3_next.py"):
            raise RuntimeError(f"could not find the pure-torch {name} in transformers' Qwen3-Next")
        setattr(M, name, f)


# --------------------------------------------------------------------------------------------
# Optional: HF semantics with float64 arithmetic everywhere
# --------------------------------------------------------------------------------------------


def _transformed(obj: Any, replacements: list[tuple[str, str]], ns: dict[str, Any], strip_decorators: bool):
    """Re-create ``obj`` (function or method) from its source with string replacements, in ``ns``."""
    import inspect
    import textwrap

    src = textwrap.dedent(inspect.getsource(obj))
    if strip_decorators:
        lines = src.splitlines(keepends=True)
        start = next(i for i, ln in enumerate(lines) if ln.startswith("def "))
        src = "".join(lines[start:])
    for old, new in replacements:
        if old not in src:
            raise RuntimeError(f"exact_fp64: {old!r} not found in the source of {obj.__qualname__}; "
                               "transformers changed, update tests/oracle.py")
        src = src.replace(old, new)
    code = compile(src, f"<exact_fp64 {obj.__qualname__}>", "exec")
    local: dict[str, Any] = {}
    exec(code, ns, local)
    (fn,) = local.values()
    return fn


def _exact_rotary_forward(self, x, position_ids):
    if self.rope_type != "default":
        raise NotImplementedError("exact_fp64 only supports the default RoPE")
    cfg = self.config
    base = cfg.rope_parameters["rope_theta"]
    prf = cfg.rope_parameters.get("partial_rotary_factor", 1.0)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dim = int(head_dim * prf)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64, device=x.device) / dim))
    freqs = position_ids[..., None].to(torch.float64) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos() * self.attention_scaling
    sin = emb.sin() * self.attention_scaling
    return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


class exact_fp64:
    """Context manager: run transformers' Qwen3-Next with float64 arithmetic everywhere.

    Stock HF computes RMSNorms, RoPE, router softmax/top-k and the gated-delta-rule core in
    float32 even for a float64 model (see HF_FP64_NOTES). Inside this context those functions are
    replaced by copies of HF's own source with every float32 cast turned into float64 (RoPE is
    recomputed from the config in float64), so a float64 model becomes float64 end to end and an
    implementation can be compared at ~1e-10 instead of ~1e-6. Patches are class/global-level and
    undone on exit; use only with float64 models (float32 models would be upcast internally).
    """

    def __enter__(self):
        import transformers.models.qwen3_next.modeling_qwen3_next as M

        force_torch_fallbacks()
        ns = dict(M.__dict__)
        ns["_XDT"] = torch.float64
        gdn_repl = [("torch.float32", "_XDT")]
        ns["torch_chunk_gated_delta_rule"] = _transformed(M.torch_chunk_gated_delta_rule, gdn_repl, ns, True)
        ns["torch_recurrent_gated_delta_rule"] = _transformed(M.torch_recurrent_gated_delta_rule, gdn_repl, ns, True)
        patches = {
            (M.Qwen3NextRMSNorm, "forward"): _transformed(
                M.Qwen3NextRMSNorm.forward,
                [("x.float()", "x.to(_XDT)"), ("self.weight.float()", "self.weight.to(_XDT)")], ns, False),
            (M.Qwen3NextRMSNormGated, "forward"): _transformed(
                M.Qwen3NextRMSNormGated.forward, [("torch.float32", "_XDT")], ns, False),
            (M.Qwen3NextTopKRouter, "forward"): _transformed(
                M.Qwen3NextTopKRouter.forward, [("dtype=torch.float,", "dtype=_XDT,")], ns, False),
            (M.Qwen3NextGatedDeltaNet, "forward"): _transformed(
                M.Qwen3NextGatedDeltaNet.forward, [(".float()", ".to(_XDT)")], ns, False),
            (M.Qwen3NextRotaryEmbedding, "forward"): _exact_rotary_forward,
        }
        # Attention itself is left alone: sdpa (the default here) is float64 already; a model built
        # with attn_implementation="eager" would still softmax in float32.
        self._saved = {k: k[0].__dict__[k[1]] for k in patches}
        for (cls, attr), fn in patches.items():
            setattr(cls, attr, fn)
        return self

    def __exit__(self, *exc):
        for (cls, attr), fn in self._saved.items():
            setattr(cls, attr, fn)
        return False


# --------------------------------------------------------------------------------------------
# Building / perturbing models
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def perturb_(model: torch.nn.Module, seed: int, std: float) -> None:
    """Add N(0, std) noise to every parameter, in sorted-name order from a seeded generator.

    Noise is drawn in float32 and added to the float32 parameters, so the perturbed weights are
    exactly representable in float32: converting the model to float64 afterwards is exact, and a
    float32 and a float64 copy of the same seed hold identical values.
    """
    gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + 17)
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32) * std
        p.add_(noise.to(p.dtype))


def build_hf_model(
    cfg_kwargs: dict[str, Any] | str,
    seed: int,
    perturb_std: float = 0.05,
    dtype: torch.dtype = torch.float64,
    attn_implementation: str = "sdpa",
    lm_head_scale: float = 1.0,
):
    """Deterministically build a perturbed ``Qwen3NextForCausalLM`` in eval mode.

    ``cfg_kwargs`` is a TINY_CONFIGS name or a dict of ``Qwen3NextConfig`` kwargs. The model is
    initialised with ``torch.manual_seed(seed)`` (HF init: normal(0.02) linears/embeddings, zero
    norms, ones gated-norm/dt_bias, log U(0.01, 16) A_log), then every parameter (including norms,
    A_log, dt_bias, conv1d) gets N(0, perturb_std) noise, then it is converted to ``dtype``.
    Experts run the "eager" implementation (grouped_mm rejects float64). ``lm_head_scale`` != 1
    multiplies lm_head after perturbation (sharper, less near-uniform distributions; the default
    std-0.05 models give max |logit| ~1-2 over a vocab of 128-256).
    """
    from transformers import Qwen3NextForCausalLM

    force_torch_fallbacks()
    cfg = tiny_config(cfg_kwargs)
    cfg._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(cfg)
    perturb_(model, seed, perturb_std)
    if lm_head_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(lm_head_scale)
    model.config._experts_implementation = "eager"
    model.config._attn_implementation = attn_implementation
    model.eval()
    model.to(dtype)
    return model


def load_hf_model(path: str | os.PathLike, dtype: torch.dtype = torch.float64, with_info: bool = False):
    """``Qwen3NextForCausalLM.from_pretrained`` with eager experts, sdpa attention, eval mode.

    Unexpected ``mtp.*`` keys are dropped silently by transformers
    (``_keys_to_ignore_on_load_unexpected = [r"^mtp.*"]``). With ``with_info`` returns
    ``(model, loading_info)`` where loading_info has missing/unexpected/mismatched keys.
    """
    from transformers import Qwen3NextForCausalLM

    force_torch_fallbacks()
    model, info = Qwen3NextForCausalLM.from_pretrained(
        str(path),
        dtype=dtype,
        experts_implementation="eager",
        attn_implementation="sdpa",
        output_loading_info=True,
    )
    model.config._experts_implementation = "eager"
    model.eval()
    return (model, info) if with_info else model


# --------------------------------------------------------------------------------------------
# MTP weights
# --------------------------------------------------------------------------------------------


def _cfg_key(cfg_kwargs: dict[str, Any] | str) -> str:
    kw = TINY_CONFIGS[cfg_kwargs] if isinstance(cfg_kwargs, str) else cfg_kwargs
    return json.dumps(kw, sort_keys=True, default=str)


@lru_cache(maxsize=None)
def _mtp_layer_shapes_cached(key: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Names/shapes save_pretrained writes for a full-attention MoE decoder layer (as layer 0)."""
    from safetensors import safe_open
    from transformers import Qwen3NextForCausalLM

    kw = json.loads(key)
    kw.pop("full_attention_interval", None)
    kw.update(num_hidden_layers=1, layer_types=[_F], mlp_only_layers=[], decoder_sparse_step=1)
    cfg = tiny_config(kw)
    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(cfg)
    out: list[tuple[str, tuple[int, ...]]] = []
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
            for k in f.keys():
                if k.startswith("model.layers.0."):
                    out.append((k[len("model.layers.0.") :], tuple(f.get_slice(k).get_shape())))
    return tuple(sorted(out))


def mtp_param_shapes(cfg_kwargs: dict[str, Any] | str) -> dict[str, tuple[int, ...]]:
    """On-disk names and shapes of every ``mtp.*`` tensor for this config (num_nextn = 1).

    ``mtp.layers.0.*`` is derived from what ``save_pretrained`` writes for a full-attention MoE
    decoder layer (experts split per expert), not hand-written.
    """
    kw = TINY_CONFIGS[cfg_kwargs] if isinstance(cfg_kwargs, str) else cfg_kwargs
    H = kw["hidden_size"]
    shapes: dict[str, tuple[int, ...]] = {
        "mtp.fc.weight": (H, 2 * H),
        "mtp.norm.weight": (H,),
        "mtp.pre_fc_norm_embedding.weight": (H,),
        "mtp.pre_fc_norm_hidden.weight": (H,),
    }
    for name, shape in _mtp_layer_shapes_cached(_cfg_key(kw)):
        shapes[f"mtp.layers.0.{name}"] = shape
    return dict(sorted(shapes.items()))


def make_mtp_state_dict(
    cfg_kwargs: dict[str, Any] | str, seed: int, std: float = 0.05
) -> dict[str, torch.Tensor]:
    """Random ``mtp.*`` weights (float32, contiguous) with the real checkpoint names and shapes.

    Every tensor is N(0, std): zero-centred RMSNorm weights (pre_fc_norm_*, input/post-attention
    layernorm, q_norm/k_norm, mtp.norm) thus act as 1 + small noise; projections, router, experts,
    shared expert and its gate get small random weights. Deterministic in (config, seed, std).
    """
    gen = torch.Generator().manual_seed(int(seed) * 7_919 + 4_242)
    out: dict[str, torch.Tensor] = {}
    for name, shape in mtp_param_shapes(cfg_kwargs).items():
        out[name] = (torch.randn(shape, generator=gen, dtype=torch.float32) * std).contiguous()
    return out


# --------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------


def save_checkpoint(
    model,
    path: str | os.PathLike,
    mtp_state: dict[str, torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
    shard_size: int | str | None = None,
) -> Path:
    """Write an HF checkpoint directory (config.json, generation_config.json, safetensors).

    - ``dtype``: save a converted copy (the passed model is left untouched); default: as is.
    - ``shard_size``: passed to ``save_pretrained(max_shard_size=...)`` (bytes or e.g. "40KB") to
      get a sharded checkpoint with ``model.safetensors.index.json``.
    - ``mtp_state``: extra ``mtp.*`` tensors, cast to the checkpoint's float dtype and appended
      to the safetensors file. When sharded they are spread round-robin over ALL shards (so a
      loader must really follow the index; an MTP layer's tensors end up in several files), and
      the index's weight_map / total_size are updated.
    Returns the directory path.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    to_save = model
    if dtype is not None and next(model.parameters()).dtype != dtype:
        to_save = copy.deepcopy(model).to(dtype)
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if shard_size is not None:
        kwargs["max_shard_size"] = shard_size
    try:
        to_save.save_pretrained(str(path), **kwargs)
    except TypeError:
        kwargs.pop("safe_serialization")
        to_save.save_pretrained(str(path), **kwargs)

    if not mtp_state:
        return path

    index_path = path / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
        files = sorted(set(index["weight_map"].values()))
    else:
        index = None
        files = ["model.safetensors"]
        assert (path / files[0]).exists(), f"no model.safetensors in {path}"

    contents: dict[str, dict[str, torch.Tensor]] = {}
    metas: dict[str, dict[str, str]] = {}
    ckpt_dtype: torch.dtype | None = None
    for fn in files:
        with safe_open(str(path / fn), "pt") as f:
            metas[fn] = f.metadata() or {"format": "pt"}
            contents[fn] = {k: f.get_tensor(k) for k in f.keys()}
            for t in contents[fn].values():
                if t.is_floating_point() and ckpt_dtype is None:
                    ckpt_dtype = t.dtype
    ckpt_dtype = ckpt_dtype or torch.float32

    added = 0
    for i, name in enumerate(sorted(mtp_state)):
        if not name.startswith("mtp."):
            raise ValueError(f"mtp_state key {name!r} does not start with 'mtp.'")
        fn = files[i % len(files)]
        t = mtp_state[name].detach().to("cpu", ckpt_dtype).contiguous().clone()
        if any(name in c for c in contents.values()):
            raise ValueError(f"{name} already in checkpoint")
        contents[fn][name] = t
        added += t.numel() * t.element_size()
        if index is not None:
            index["weight_map"][name] = fn

    for fn in files:
        save_file(contents[fn], str(path / fn), metadata=metas[fn])
    if index is not None:
        index.setdefault("metadata", {})
        if "total_size" in index["metadata"]:
            index["metadata"]["total_size"] = int(index["metadata"]["total_size"]) + added
        if "total_parameters" in index["metadata"]:
            index["metadata"]["total_parameters"] = int(index["metadata"]["total_parameters"]) + sum(
                int(t.numel()) for t in mtp_state.values()
            )
        index["weight_map"] = dict(sorted(index["weight_map"].items()))
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return path


# --------------------------------------------------------------------------------------------
# Reference forward / greedy
# --------------------------------------------------------------------------------------------


def _device_of(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    """Logits [seq, vocab] of one uncached forward over ``token_ids`` (model dtype)."""
    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=_device_of(model))
    out = model(input_ids=ids, use_cache=False)
    return out.logits[0].detach().cpu()


# Two separately built or loaded models hold equal weights in different allocations. MKL picks
# its code path by CPU (AVX-512 vs AVX2) and by alignment, so the same fp64 computation through
# them can differ in the last ulp (2.2e-16 seen on an AMD EPYC). Bitwise equality is therefore
# only asserted where it holds by construction (same model, same buffers); across separate
# loads fp64 logits must agree to SEPARATE_LOAD_ATOL. A real bug (a missing, wrong or perturbed
# weight) moves logits by far more: a single saved weight perturbed by 1e-6 moves them by > 1e-9
# (tests/test_oracle.py::test_separate_load_tolerance_catches_a_perturbed_weight), while
# rounding differences stay at ~1e-15 (logits are O(1), ~1e4 ulps of headroom).
SEPARATE_LOAD_ATOL = 1e-11


def assert_same_logits(got: torch.Tensor, want: torch.Tensor, atol: float = SEPARATE_LOAD_ATOL) -> None:
    """fp64 logits of two separately loaded models agree up to rounding (see above)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    torch.testing.assert_close(got, want, rtol=0, atol=atol)


def _plain_greedy_config(model, max_new_tokens: int):
    from transformers import GenerationConfig

    # A fresh config: no eos (so exactly max_new_tokens come out; this is not min_new_tokens,
    # which would instead force eos to -inf), no repetition penalty or other processors.
    return GenerationConfig(
        do_sample=False,
        num_beams=1,
        max_new_tokens=max_new_tokens,
        min_new_tokens=None,
        eos_token_id=None,
        pad_token_id=0,
        bos_token_id=None,
        use_cache=True,
        output_logits=True,
        return_dict_in_generate=True,
    )


@torch.no_grad()
def _greedy_generate(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    model.generation_config.eos_token_id = None
    if getattr(model.config, "eos_token_id", None) is not None:
        model.config.eos_token_id = None
    gc = _plain_greedy_config(model, max_new_tokens)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=_device_of(model))
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gc)
    seq = out.sequences[0, len(prompt_ids) :].tolist()
    logits = [lg[0].detach().cpu() for lg in out.logits]
    return seq, logits


@torch.no_grad()
def _greedy_loop(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    dev = _device_of(model)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=dev)
    out = model(input_ids=ids, use_cache=True)
    cache = out.cache
    seq: list[int] = []
    logits: list[torch.Tensor] = []
    for step in range(max_new_tokens):
        lg = out.logits[0, -1].detach()
        tok = int(lg.argmax())
        seq.append(tok)
        logits.append(lg.cpu())
        if step + 1 == max_new_tokens:
            break
        out = model(input_ids=torch.tensor([[tok]], device=dev), cache=cache, use_cache=True)
        cache = out.cache
    return seq, logits


def hf_greedy_with_logits(
    model, prompt_ids: list[int], max_new_tokens: int, method: str = "generate"
) -> tuple[list[int], list[torch.Tensor]]:
    """HF greedy decode with the model's cache for exactly ``max_new_tokens`` new tokens.

    Returns (new tokens only, per-step logits [vocab] that produced each token).
    - method="generate" (default): ``model.generate`` with a fresh greedy GenerationConfig, eos
      disabled on the call and on ``model.generation_config`` (not min_new_tokens, which would
      force eos to -inf). NOTE: generate casts each step's logits to float32 before the argmax
      (``transformers.generation.utils``), so these step logits are float32 even for a float64 model.
    - method="loop": the same cached decode written out (prefill, then one token per forward with
      ``cache=``), argmax on and returning the model-dtype (e.g. float64) logits.
    """
    if max_new_tokens <= 0:
        return [], []
    if len(prompt_ids) == 0:
        raise ValueError("prompt must be non-empty")
    if method == "generate":
        seq, logits = _greedy_generate(model, prompt_ids, max_new_tokens)
    elif method == "loop":
        seq, logits = _greedy_loop(model, prompt_ids, max_new_tokens)
    else:
        raise ValueError(f"unknown method {method!r}")
    if len(seq) != max_new_tokens or len(logits) != max_new_tokens:
        raise RuntimeError(f"HF greedy returned {len(seq)} tokens / {len(logits)} logits, wanted {max_new_tokens}")
    return seq, logits


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, method: str = "generate") -> list[int]:
    """HF greedy (cached) for exactly ``max_new_tokens`` new tokens; returns only the new tokens."""
    return hf_greedy_with_logits(model, prompt_ids, max_new_tokens, method=method)[0]


# --------------------------------------------------------------------------------------------
# Tie-aware comparison
# --------------------------------------------------------------------------------------------


@dataclass
class TieReport:
    ok: bool
    identical: bool
    tie_at: int | None = None  # index of the first divergence accepted as a near-tie
    gap: float | None = None  # |ref_logit[ref tok] - ref_logit[our tok]| at the first divergence
    diverge_at: int | None = None  # first index where the sequences differ (tie or not)
    compared: int = 0  # number of positions compared
    reason: str = ""
    ours: list[int] = field(default_factory=list, repr=False)
    ref: list[int] = field(default_factory=list, repr=False)
    tol: float = 0.0
    ties: list[tuple[int, float]] = field(default_factory=list)  # all accepted ties (re-anchored)

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        head = "OK" if self.ok else "MISMATCH"
        if self.identical:
            return f"{head}: identical greedy sequences ({self.compared} tokens)"
        lines = [f"{head}: {self.reason}"]
        i = self.diverge_at
        if i is not None:
            lo = max(0, i - 3)
            lines.append(f"  ours[{lo}:{i + 3}] = {self.ours[lo : i + 3]}")
            lines.append(f"  ref [{lo}:{i + 3}] = {self.ref[lo : i + 3]}")
        if self.ties:
            lines.append(f"  accepted ties (index, gap): {self.ties}  tol={self.tol:g}")
        lines.append(f"  len(ours)={len(self.ours)} len(ref)={len(self.ref)}")
        return "\n".join(lines)


def compare_greedy_tie_aware(
    ours: list[int],
    ref: list[int],
    ref_step_logits: list[torch.Tensor],
    tol: float = 1e-3,
) -> TieReport:
    """Compare greedy token sequences, forgiving one divergence that is a near-tie of the reference.

    identical (same tokens, same length) -> ok. Otherwise at the first divergence i the comparison
    is ok only if |ref_step_logits[i][ours[i]] - ref_step_logits[i][ref[i]]| < tol; the sequences
    are then compared only up to i (after a tie they legitimately differ). A length mismatch with
    no divergence inside the common prefix is a failure.
    """
    ours, ref = [int(t) for t in ours], [int(t) for t in ref]
    common = min(len(ours), len(ref))
    i = next((j for j in range(common) if ours[j] != ref[j]), None)
    base = dict(ours=ours, ref=ref, tol=tol)
    if i is None:
        if len(ours) == len(ref):
            return TieReport(ok=True, identical=True, compared=common, **base)
        return TieReport(
            ok=False,
            identical=False,
            diverge_at=common,
            compared=common,
            reason=f"length mismatch: ours has {len(ours)} tokens, ref has {len(ref)} (common prefix equal)",
            **base,
        )
    if i >= len(ref_step_logits):
        raise ValueError(f"no reference logits for step {i} (have {len(ref_step_logits)})")
    lg = ref_step_logits[i].detach().to("cpu", torch.float64).reshape(-1)
    vocab = lg.numel()
    if not (0 <= ours[i] < vocab):
        return TieReport(
            ok=False, identical=False, diverge_at=i, compared=i + 1,
            reason=f"step {i}: our token {ours[i]} is outside the vocab ({vocab})", **base,
        )
    ref_val, our_val = float(lg[ref[i]]), float(lg[ours[i]])
    gap = abs(ref_val - our_val)
    top = float(lg.max())
    detail = (
        f"step {i}: ours={ours[i]} (ref logit {our_val:.6g}) vs ref={ref[i]} (ref logit {ref_val:.6g}), "
        f"gap={gap:.3g}, ref max logit {top:.6g}, tol={tol:g}"
    )
    if gap < tol:
        return TieReport(
            ok=True, identical=False, tie_at=i, gap=gap, diverge_at=i, compared=i + 1,
            reason=f"near-tie accepted at {detail}; compared up to the tie only",
            ties=[(i, gap)], **base,
        )
    return TieReport(
        ok=False, identical=False, gap=gap, diverge_at=i, compared=i + 1,
        reason=f"real divergence at {detail}", **base,
    )


def assert_greedy_matches(
    ours: list[int],
    ref: list[int],
    ref_step_logits: list[torch.Tensor],
    tol: float = 1e-3,
    context: str = "",
) -> TieReport:
    """:func:`compare_greedy_tie_aware`, raising AssertionError with a readable report on failure."""
    rep = compare_greedy_tie_aware(ours, ref, ref_step_logits, tol=tol)
    if not rep.ok:
        raise AssertionError((f"[{context}] " if context else "") + str(rep))
    return rep


def check_greedy_against_hf(
    model,
    prompt_ids: list[int],
    ours: list[int],
    tol: float = 1e-3,
    max_ties: int = 4,
    method: str = "generate",
) -> TieReport:
    """Check a whole greedy continuation ``ours`` against HF, re-anchoring after near-ties.

    Runs HF greedy for len(ours) tokens; at an accepted near-tie at i, restarts HF greedy from
    prompt + ours[:i+1] and keeps checking the rest, so every position is verified (up to
    ``max_ties`` ties; beyond that the report fails).
    """
    ours = [int(t) for t in ours]
    ties: list[tuple[int, float]] = []
    ref_full: list[int] = []  # HF's greedy token at each position, given OUR prefix
    start = 0
    while True:
        n = len(ours) - start
        ref, logits = ([], []) if n == 0 else hf_greedy_with_logits(
            model, list(prompt_ids) + ours[:start], n, method=method
        )
        rep = compare_greedy_tie_aware(ours[start:], ref, logits, tol=tol)
        common = dict(ours=ours, tol=tol, ties=ties)
        if rep.identical:
            ref_full += ref
            first = ties[0] if ties else (None, None)
            return TieReport(
                ok=True, identical=not ties, tie_at=first[0], gap=first[1], diverge_at=first[0],
                compared=len(ours), ref=ref_full,
                reason=f"matches HF with {len(ties)} accepted near-tie(s), re-anchored after each"
                if ties else "identical",
                **common,
            )
        i = start + (rep.diverge_at or 0)
        if not rep.ok or len(ties) >= max_ties:
            ref_full += ref
            why = rep.reason if not rep.ok else f"more than {max_ties} near-ties"
            return TieReport(
                ok=False, identical=False, gap=rep.gap, diverge_at=i, compared=i + 1, ref=ref_full,
                reason=f"after {start} checked tokens (prompt re-anchored on our prefix): {why}",
                **common,
            )
        ties.append((i, float(rep.gap)))
        ref_full += ref[: i - start + 1]
        start = i + 1


# --------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------

# Lengths worth covering: single token, tiny, around the GDN chunk size (64) and past it.
PROMPT_LENGTHS: tuple[int, ...] = (1, 2, 3, 5, 8, 13, 31, 63, 64, 65, 100)


def random_prompt(length: int, vocab_size: int, seed: int) -> list[int]:
    """One deterministic random prompt of exactly ``length`` tokens in [0, vocab_size)."""
    gen = torch.Generator().manual_seed(int(seed) * 31_337 + length)
    return torch.randint(0, vocab_size, (length,), generator=gen).tolist()


def random_prompts(
    n: int,
    vocab_size: int,
    seed: int,
    min_len: int = 1,
    max_len: int = 40,
    lengths: list[int] | tuple[int, ...] | None = None,
) -> list[list[int]]:
    """``n`` deterministic random prompts of different lengths within the vocab.

    With ``lengths`` given they are used cyclically; otherwise lengths are drawn from
    [min_len, max_len], always including min_len and max_len when n >= 2.
    """
    gen = torch.Generator().manual_seed(int(seed) + 99_991)
    if lengths is None:
        if n <= 0:
            return []
        lens = torch.randint(min_len, max_len + 1, (n,), generator=gen).tolist()
        if n >= 2:
            lens[0], lens[1] = min_len, max_len
        perm = torch.randperm(n, generator=gen).tolist()
        lens = [lens[j] for j in perm]
    else:
        lens = [int(lengths[j % len(lengths)]) for j in range(n)]
    return [
        torch.randint(0, vocab_size, (L,), generator=gen).tolist() for L in lens
    ]


class single_thread:
    """Context manager: torch.set_num_threads(1) (restored on exit).

    The tiny models are far too small to profit from intra-op threads, and on a shared, loaded
    machine the OpenMP spinning of several threads made this file's tests ~7x slower.
    """

    def __enter__(self):
        self._n = torch.get_num_threads()
        torch.set_num_threads(1)
        return self

    def __exit__(self, *exc):
        torch.set_num_threads(self._n)
        return False


def param_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def max_abs_logit(model, prompt: list[int]) -> float:
    return float(hf_logits(model, prompt).abs().max())


if __name__ == "__main__":  # quick survey: params, logit scale, cached-vs-uncached agreement
    import time

    for nm, kw in TINY_CONFIGS.items():
        t0 = time.time()
        m = build_hf_model(kw, seed=0)
        p = random_prompt(20, kw["vocab_size"], 0)
        lg = hf_logits(m, p)
        toks, step = hf_greedy_with_logits(m, p, 8)
        full = hf_logits(m, p + toks)
        d = max(float((step[j] - full[len(p) - 1 + j]).abs().max()) for j in range(8))
        top2 = lg.topk(2, dim=-1).values
        print(
            f"{nm:20s} params={param_count(m):7d} max|logit|={float(lg.abs().max()):.3f} "
            f"std={float(lg.std()):.3f} min top1-top2={float((top2[:, 0] - top2[:, 1]).min()):.2e} "
            f"cached-vs-uncached={d:.2e} {time.time() - t0:.2f}s"
        )
