"""Gemma 4 text-decoder shapes at real size, for dummy-weight and meta-device checks.

From the Gemma 4 reference notes this project was written against (not in the repository):
26B-A4B hidden 2816, 16 heads, kv 8, head_dim 256, global head_dim 512, global kv 2, 128
experts top-8; 31B 60 layers, hidden 5376, 32 heads, kv 16,
global kv 4, window 1024. The reference does not give the other fields (intermediate sizes,
26B-A4B's layer count and window, any E2B / E4B size): those below are ASSUMED (the published
model cards' values as far as known here) and marked so; they set the tensor sizes only.
"""

_COMMON = dict(model_type="gemma4_text", vocab_size=262144, head_dim=256, global_head_dim=512,
               rms_norm_eps=1e-6, final_logit_softcapping=30.0, max_position_embeddings=131072,
               tie_word_embeddings=True)

REAL = {
    "31B": dict(_COMMON, hidden_size=5376, num_hidden_layers=60, num_attention_heads=32, num_key_value_heads=16,
                num_global_key_value_heads=4, attention_k_eq_v=True, sliding_window=1024,
                intermediate_size=21504,                                   # assumed
                hidden_size_per_layer_input=0),
    "26B-A4B": dict(_COMMON, hidden_size=2816, num_attention_heads=16, num_key_value_heads=8,
                    num_global_key_value_heads=2, attention_k_eq_v=True, enable_moe_block=True, num_experts=128,
                    top_k_experts=8,
                    num_hidden_layers=30, sliding_window=1024, intermediate_size=2112,   # assumed
                    moe_intermediate_size=704,                                          # assumed
                    hidden_size_per_layer_input=0),
    # E4B / E2B: every size assumed; per-layer embeddings, KV-shared layers (E2B: double-wide MLP).
    "E4B": dict(_COMMON, hidden_size=2560, num_hidden_layers=42, num_attention_heads=8, num_key_value_heads=2,
                intermediate_size=10240, sliding_window=512, hidden_size_per_layer_input=256,
                vocab_size_per_layer_input=262144, num_kv_shared_layers=18),
    "E2B": dict(_COMMON, hidden_size=1536, num_hidden_layers=35, num_attention_heads=8, num_key_value_heads=1,
                intermediate_size=6144, sliding_window=512, hidden_size_per_layer_input=256,
                vocab_size_per_layer_input=262144, num_kv_shared_layers=20, use_double_wide_mlp=True),
}


def scaled(name: str, layers: int, vocab: int) -> dict:
    """Real widths with fewer layers (one sliding/full pattern at least) and a smaller
    vocabulary, for a dummy engine run on CPU. KV-shared layers scale with the layer count."""
    raw = dict(REAL[name], num_hidden_layers=layers, vocab_size=vocab)
    if raw.get("hidden_size_per_layer_input"):
        raw["vocab_size_per_layer_input"] = vocab
    if raw.get("num_kv_shared_layers"):
        raw["num_kv_shared_layers"] = layers // 2
    # alternating, so the non-shared first half holds both types for the shared layers to read
    raw["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    return raw
