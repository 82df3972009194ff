"""Tiny random Gemma 4 checkpoints built and run by transformers 5.24 (the oracle).

Each config exercises a set of the text decoder's features, with sliding windows shorter
than the test prompts: DENSE (attention_k_eq_v, full layers with another head_dim and fewer
KV heads, final softcapping), MOE (MLP + experts, router scales), E2B (per-layer
embeddings, KV-shared layers, double-wide MLP), MM (the ForConditionalGeneration layout with
vision and audio towers in the checkpoint). Weights: HF's init, then N(0, 0.05) on every
parameter, layer_scalar drawn in [0.5, 1.5] and the embedding (tied head) scaled x4, so
distributions are far from uniform.
"""

from __future__ import annotations

import torch

S, F = "sliding_attention", "full_attention"

_BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=512, hidden_size_per_layer_input=0,
             pad_token_id=0, eos_token_id=1, bos_token_id=2)

CONFIGS: dict[str, dict] = {
    "dense": dict(_BASE, num_hidden_layers=6, layer_types=[S, S, F, S, S, F], sliding_window=5,
                  attention_k_eq_v=True, global_head_dim=32, num_global_key_value_heads=1,
                  final_logit_softcapping=30.0),
    "moe": dict(_BASE, num_hidden_layers=4, layer_types=[S, F, S, F], sliding_window=7, global_head_dim=24,
                enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32,
                final_logit_softcapping=30.0),
    "e2b": dict(_BASE, num_hidden_layers=5, layer_types=[S, F, S, S, F], sliding_window=6, global_head_dim=32,
                hidden_size_per_layer_input=8, vocab_size_per_layer_input=128, num_kv_shared_layers=2,
                use_double_wide_mlp=True),
}
CONFIGS["mm"] = dict(CONFIGS["dense"], num_hidden_layers=4, layer_types=[S, F, S, F], sliding_window=4)
MULTIMODAL = {"mm"}


def build_hf(name: str, seed: int = 0, config: dict | None = None):
    """A perturbed float64 HF model of config `name` (eval mode, eager experts, sdpa);
    `config`: another text config under that name's layout (multimodal or not)."""
    from transformers.models.gemma4 import (Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration,
                                            Gemma4TextConfig)
    text = Gemma4TextConfig(**(CONFIGS[name] if config is None else config))
    torch.manual_seed(seed)
    if name in MULTIMODAL:
        cfg = Gemma4Config(text_config=text.to_dict(),
                           vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                              num_attention_heads=2, num_key_value_heads=2, head_dim=8),
                           audio_config=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                             output_proj_dims=16))
        model = Gemma4ForConditionalGeneration(cfg)
        embed = model.model.language_model.embed_tokens.weight
    else:
        model = Gemma4ForCausalLM(text)
        embed = model.model.embed_tokens.weight
    gen = torch.Generator().manual_seed(seed * 1_000_003 + 17)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        for bname, b in sorted(model.named_buffers()):
            if bname.endswith("layer_scalar"):
                b.copy_(torch.rand(b.shape, generator=gen) + 0.5)
        embed.mul_(4.0)
    for c in (model.config, getattr(model.config, "text_config", None)):
        if c is not None:
            c._experts_implementation = "eager"
            c._attn_implementation = "sdpa"
    model.eval()
    return model.to(torch.float64)


def save(model, path) -> None:
    model.save_pretrained(str(path))


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    out = model(input_ids=torch.tensor([ids]), use_cache=False)
    return out.logits[0]
