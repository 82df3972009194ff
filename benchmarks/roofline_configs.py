"""The configs benchmarks/roofline.py runs (random weights: config.json files only): Qwen3-Next
80B-A3B and Gemma 4 31B / 26B-A4B at their real layer shapes with fewer layers, and the Gemma 4
assistant that drafts for them.

Gemma 4's widths are tests/gemma4_shapes.py's (the sizes that file
marks ASSUMED are assumptions). The reference gives no shapes for the real assistants: the ones
below (ASSISTANT) are assumptions too, except what the assistant must share with its target
(head_dim and KV heads per layer type, window, RoPE, vocabulary, backbone_hidden_size = the
target's hidden size), which is copied from the target. A real assistant's config.json can be
given instead (roofline.py --assistant-config).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import gemma4_shapes  # noqa: E402

MODELS = ("qwen3-next", "gemma4-31b", "gemma4-26b-a4b")
GEMMA4 = {"gemma4-31b": "31B", "gemma4-26b-a4b": "26B-A4B"}

# ASSUMED (not in the reference): the assistant's own sizes, one set for both targets. The
# centroid head (use_ordered_embeddings; transformers' defaults of 2048 centroids, top 32) is
# what makes a small drafter's output layer cheap at a 262k vocabulary.
ASSISTANT = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=4, use_ordered_embeddings=True,
                 num_centroids=2048, centroid_intermediate_top_k=32)


def qwen3_next_config(layers: int, experts: int = 512) -> dict:
    # Qwen/Qwen3-Next-80B-A3B-Instruct with fewer layers (3:1 GDN : full attention).
    return dict(model_type="qwen3_next", vocab_size=151936, hidden_size=2048,
                num_hidden_layers=layers, full_attention_interval=4, num_attention_heads=16,
                num_key_value_heads=2, head_dim=256, intermediate_size=5120,
                linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=experts,
                num_experts_per_tok=10, moe_intermediate_size=512,
                shared_expert_intermediate_size=512, norm_topk_prob=True, decoder_sparse_step=1,
                mlp_only_layers=[], rms_norm_eps=1e-6, max_position_embeddings=262144,
                rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
                tie_word_embeddings=False, eos_token_id=151645, dtype="bfloat16")


def layer_pattern(layers: int, full_every: int = 6) -> list[str]:
    """Gemma 4's pattern (5 sliding, 1 full) over `layers` layers, the last one full (as
    transformers forces it)."""
    types = ["full_attention" if (i + 1) % full_every == 0 else "sliding_attention" for i in range(layers)]
    types[-1] = "full_attention"
    return types


def gemma4_config(model: str, layers: int, vocab: int | None = None) -> dict:
    """The real target's config.json (gemma4_shapes.REAL: per-layer head_dim and KV heads from
    global_head_dim / num_global_key_value_heads with attention_k_eq_v, tied lm_head, final
    softcap, the 26B-A4B's MoE beside its dense MLP) with `layers` layers in the 5:1 pattern."""
    raw = dict(gemma4_shapes.REAL[GEMMA4[model]], num_hidden_layers=layers, layer_types=layer_pattern(layers),
               dtype="bfloat16", eos_token_id=1)
    if vocab:
        raw["vocab_size"] = vocab
    return raw


def assistant_config(target: dict, **over) -> dict:
    """A gemma4_assistant config.json for `target` (a gemma4_text config.json): ASSISTANT's
    sizes (or `over`), its layers in the 5:1 pattern, and what it must share with the target:
    head_dim / KV heads per layer type (as the target's full layers derive theirs), window,
    RoPE, vocabulary; as many attention heads as the target (a multiple of both KV counts)."""
    sizes = {**ASSISTANT, **over}
    n = sizes["num_hidden_layers"]
    text = dict(model_type="gemma4_text", vocab_size=target["vocab_size"], hidden_size=sizes["hidden_size"],
                intermediate_size=sizes["intermediate_size"], num_hidden_layers=n,
                num_attention_heads=target["num_attention_heads"], num_key_value_heads=target["num_key_value_heads"],
                head_dim=target["head_dim"], layer_types=layer_pattern(n), num_kv_shared_layers=n,
                hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, enable_moe_block=False,
                sliding_window=target.get("sliding_window", 512), rms_norm_eps=target.get("rms_norm_eps", 1e-6),
                tie_word_embeddings=True)
    for key in ("global_head_dim", "num_global_key_value_heads", "attention_k_eq_v", "rope_parameters"):
        if key in target:
            text[key] = target[key]
    if "per_layer_config" in target:   # a saved config: full layers' overrides, by the target's full layers
        full = next(over for i, over in sorted(target["per_layer_config"].items(), key=lambda kv: int(kv[0]))
                    if target["layer_types"][int(i)] == "full_attention")
        text["per_layer_config"] = {str(i): full for i, t in enumerate(text["layer_types"]) if t == "full_attention"}
    return dict(model_type="gemma4_assistant", text_config=text, backbone_hidden_size=target["hidden_size"],
                use_ordered_embeddings=sizes["use_ordered_embeddings"], num_centroids=sizes["num_centroids"],
                centroid_intermediate_top_k=sizes["centroid_intermediate_top_k"], tie_word_embeddings=True,
                dtype=target.get("dtype", "bfloat16"))
