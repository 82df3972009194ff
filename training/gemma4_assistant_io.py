"""tiny-gemma4-assistant's checkpoint: transformers' config (Gemma4AssistantConfig), the
training model's tensors under transformers' names, building (with a warm start from the
target) and loading. The model: training/gemma4_assistant.py."""

import json
from pathlib import Path

import torch

from mtpkit.models.gemma4.model import Gemma4ForCausalLM
from training.gemma4_assistant import AssistantConfig, AssistantModel

# Fields of the assistant's text_config that must equal the target's.
_FROM_TARGET = ("vocab_size", "num_key_value_heads", "head_dim", "global_head_dim", "num_global_key_value_heads",
                "attention_k_eq_v", "sliding_window", "rope_parameters", "rms_norm_eps", "max_position_embeddings",
                "eos_token_id", "bos_token_id", "pad_token_id", "initializer_range")


def hf_config(target_kwargs: dict, size: dict, ordered: dict | None = None, dtype: str = "bfloat16"):
    """transformers' Gemma4AssistantConfig: the text config takes the target's geometry per
    layer type and `size`; `ordered` = {"num_centroids": C, "centroid_intermediate_top_k": k}
    turns the centroid head on."""
    from transformers import Gemma4AssistantConfig, Gemma4TextConfig

    n = len(size["layer_types"])
    text = dict({k: target_kwargs[k] for k in _FROM_TARGET}, **size, num_hidden_layers=n, num_kv_shared_layers=n,
                hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, final_logit_softcapping=None,
                tie_word_embeddings=True)
    text = Gemma4TextConfig(**json.loads(json.dumps(text)))
    extra = dict(use_ordered_embeddings=True, **ordered) if ordered else dict(use_ordered_embeddings=False)
    return Gemma4AssistantConfig(text_config=text, backbone_hidden_size=target_kwargs["hidden_size"],
                                 tie_word_embeddings=True, dtype=dtype, architectures=["Gemma4AssistantForCausalLM"],
                                 **extra)


def config_of(path: Path) -> AssistantConfig:
    return AssistantConfig.from_dict(json.loads((Path(path) / "config.json").read_text()))


def build_assistant(c: AssistantConfig, target: Gemma4ForCausalLM, seed: int, std: float = 0.02,
                    from_target: bool = True) -> AssistantModel:
    """transformers' init (normal(0, std) matrices, norms and layer_scalar 1), then with
    `from_target` a warm start from the frozen target where shapes allow: the output head from
    the target's (tied) embedding, and each layer from the target layer whose KV it reads (its
    q_proj, q_norm, o_proj, MLP, norms, layer_scalar: that layer already queries this KV)."""
    a = AssistantModel(c, target.cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in a.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layer_scalar"):
                p.fill_(1.0)
            else:
                p.copy_(torch.empty(p.shape).normal_(0.0, std, generator=g))
        if from_target:
            tc = target.cfg
            if c.hidden_size == tc.hidden_size:
                a.embed_tokens.copy_(target.embed_tokens)
            for layer in a.layers:
                src = target.layers[max(i for i in range(tc.num_hidden_layers) if tc.layer_types[i] == layer.kind)]
                if c.hidden_size != tc.hidden_size or c.intermediate_size != tc.intermediate_size:
                    continue
                hq = src.self_attn.heads * layer.hd
                layer.q_proj.weight.copy_(src.self_attn.qkv_proj.weight[:hq])
                layer.q_norm.weight.copy_(src.self_attn.q_norm.weight)
                layer.o_proj.weight.copy_(src.self_attn.o_proj.weight)
                gate, up = src.mlp.gate_up_proj.weight.chunk(2, dim=0)
                layer.gate_proj.weight.copy_(gate)
                layer.up_proj.weight.copy_(up)
                layer.down_proj.weight.copy_(src.mlp.down_proj.weight)
                for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                          "post_feedforward_layernorm"):
                    getattr(layer, n).weight.copy_(getattr(src, n).weight)
                layer.layer_scalar.copy_(src.layer_scalar)
    return a


def hf_tensors(a: AssistantModel, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The assistant's tensors under transformers' names (the tied lm_head is not saved)."""
    out = {"model.embed_tokens.weight": a.embed_tokens, "model.norm.weight": a.norm.weight,
           "pre_projection.weight": a.pre_projection.weight, "post_projection.weight": a.post_projection.weight}
    for i, layer in enumerate(a.layers):
        pre = f"model.layers.{i}."
        for n in ("q_proj", "q_norm", "o_proj"):
            out[pre + f"self_attn.{n}.weight"] = getattr(layer, n).weight
        for n in ("gate_proj", "up_proj", "down_proj"):
            out[pre + f"mlp.{n}.weight"] = getattr(layer, n).weight
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"):
            out[pre + f"{n}.weight"] = getattr(layer, n).weight
        out[pre + "layer_scalar"] = layer.layer_scalar
    out = {n: t.detach().to(dtype).clone() for n, t in out.items()}
    if a.centroids is not None:
        out["masked_embedding.centroids.weight"] = a.centroids.weight.detach().to(dtype).clone()
        out["masked_embedding.token_ordering"] = a.token_ordering.clone()
    return out


def load_tensors(a: AssistantModel, tensors: dict[str, torch.Tensor]) -> None:
    """The inverse of hf_tensors (float32): every tensor the model has must be there."""
    want = hf_tensors(a, torch.float32)
    missing, extra = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    if missing or extra:
        raise ValueError(f"assistant checkpoint: missing {missing}, unexpected {extra}")
    with torch.no_grad():
        mine = dict(a.named_parameters())
        by_name = {"model.embed_tokens.weight": "embed_tokens", "model.norm.weight": "norm.weight",
                   "pre_projection.weight": "pre_projection.weight", "post_projection.weight": "post_projection.weight",
                   "masked_embedding.centroids.weight": "centroids.weight"}
        for i, layer in enumerate(a.layers):
            pre = f"model.layers.{i}."
            for n in ("q_proj", "q_norm", "o_proj"):
                by_name[pre + f"self_attn.{n}.weight"] = f"layers.{i}.{n}.weight"
            for n in ("gate_proj", "up_proj", "down_proj", "input_layernorm", "post_attention_layernorm",
                      "pre_feedforward_layernorm", "post_feedforward_layernorm"):
                by_name[pre + (f"mlp.{n}" if n.endswith("proj") else n) + ".weight"] = f"layers.{i}.{n}.weight"
            by_name[pre + "layer_scalar"] = f"layers.{i}.layer_scalar"
        for hf_name, t in tensors.items():
            if hf_name == "masked_embedding.token_ordering":
                a.token_ordering.copy_(t)
            else:
                mine[by_name[hf_name]].copy_(t.float())


def load_assistant(path: Path, target: Gemma4ForCausalLM) -> AssistantModel:
    from safetensors.torch import load_file

    a = AssistantModel(config_of(path), target.cfg)
    load_tensors(a, load_file(str(Path(path) / "model.safetensors")))
    return a


def export_checkpoint(a: AssistantModel, target_kwargs: dict, size: dict, target: Gemma4ForCausalLM,
                      out_dir: Path, dtype: torch.dtype = torch.bfloat16, num_assistant_tokens: int = 3) -> Path:
    """config.json (Gemma4AssistantConfig), generation_config.json (eos, and the
    num_assistant_tokens transformers' driver needs: it drafts exactly that many, constant),
    model.safetensors, tokenizer.json; checked by reloading every tensor exactly."""
    from training.checkpoint import dtype_name, write_checkpoint

    c = a.cfg
    ordered = {"num_centroids": c.num_centroids, "centroid_intermediate_top_k": c.centroid_top_k} \
        if c.num_centroids else None
    if ordered and torch.equal(a.token_ordering, torch.zeros_like(a.token_ordering)):
        raise ValueError("token_ordering is all zeros: every token would map to id 0")

    def verify(tmp: Path) -> None:
        fresh = load_assistant(tmp, target)
        want = hf_tensors(a, dtype)
        for n, t in hf_tensors(fresh, dtype).items():
            if not torch.equal(t, want[n]):
                raise AssertionError(f"exported assistant does not reload {n} exactly")

    return write_checkpoint(out_dir, hf_config(target_kwargs, size, ordered, dtype_name(dtype)), hf_tensors(a, dtype),
                            verify, generation={"num_assistant_tokens": num_assistant_tokens,
                                                "num_assistant_tokens_schedule": "constant"})
