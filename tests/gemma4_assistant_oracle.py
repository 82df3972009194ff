"""Tiny random Gemma 4 assistants (model_type gemma4_assistant) for the tiny targets of
gemma4_oracle.py, built by transformers 5.24, and transformers' own drafts for a committed
context (the oracle: `SinglePositionMultiTokenCandidateGenerator.get_candidates`, fed the
target's outputs exactly as `generate(assistant_model=...)` feeds it).

Assistants: three layers [sliding, sliding, full] with the target's per-type geometry (head
dims, KV heads, window, RoPE), another hidden size (48) unless built to agree, and HF's init
perturbed like the targets'. `ordered`: the centroid head (16 clusters of 8 tokens, top 4)
with a random token_ordering permutation.

Agreement ("agree" = eps): the target's sub-layer outputs are scaled by eps (the post
norms' weights: Gemma normalises after each projection) so it acts like a bigram model
b(x) = argmax(E . norm(E[x])); the assistant computes the same bigram of the token it is
fed (pre_projection = [I | 0], its own post norms scaled by eps, the target's final norm and
embedding table). eps 0 accepts nearly every draft, larger eps a mix.
"""

from __future__ import annotations

import torch

import gemma4_oracle as G

S, F = G.S, G.F
ASSISTANT_LAYERS = [S, S, F]   # transformers forces the last layer to full attention
# Fields of the target's text config the assistant shares (per-type geometry, RoPE, window).
_SHARED = ("vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim", "global_head_dim",
           "num_global_key_value_heads", "attention_k_eq_v", "sliding_window", "rms_norm_eps",
           "max_position_embeddings", "pad_token_id", "eos_token_id", "bos_token_id", "rope_parameters")


# The targets: gemma4_oracle's, and a 16-token vocabulary (sampling distributions).
TARGETS = dict(G.CONFIGS, dense_v16=dict(G.CONFIGS["dense"], vocab_size=16))


def build_target(name: str, seed: int = 0):
    return G.build_hf(name, seed, config=TARGETS[name])


def assistant_config(name: str, *, ordered: bool = False, hidden: int = 48, **overrides):
    from transformers.models.gemma4 import Gemma4TextConfig
    from transformers.models.gemma4_assistant import Gemma4AssistantConfig
    base = TARGETS[name]
    text = {k: base[k] for k in _SHARED if k in base}
    text.update(hidden_size=hidden, intermediate_size=80, num_hidden_layers=len(ASSISTANT_LAYERS),
                layer_types=list(ASSISTANT_LAYERS), hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)
    text.update(overrides.pop("text", {}))
    top = dict(backbone_hidden_size=base["hidden_size"], use_ordered_embeddings=ordered)
    if ordered:
        top.update(num_centroids=16, centroid_intermediate_top_k=4)
    top.update(overrides)
    return Gemma4AssistantConfig(text_config=Gemma4TextConfig(**text).to_dict(), **top)


def _finish(model):
    model.config.get_text_config()._attn_implementation = "sdpa"
    model.eval()
    return model.to(torch.float64)


def build_assistant(name: str, seed: int = 0, *, ordered: bool = False, agree_with=None, eps: float = 0.0,
                    **overrides):
    """A float64 HF assistant for target config `name`. `agree_with` (the HF target, itself
    made with `bigram_target(..., eps)`): built to predict what that target predicts."""
    from transformers import Gemma4AssistantForCausalLM
    cfg = assistant_config(name, ordered=ordered, hidden=TARGETS[name]["hidden_size"] if agree_with is not None
                           else 48, **overrides)
    torch.manual_seed(seed + 101)
    model = Gemma4AssistantForCausalLM(cfg)
    gen = torch.Generator().manual_seed(seed * 7919 + 3)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        for bname, b in sorted(model.named_buffers()):
            if bname.endswith("layer_scalar"):
                b.copy_(torch.rand(b.shape, generator=gen) + 0.5)
        model.model.embed_tokens.weight.mul_(4.0)
        if ordered:
            model.masked_embedding.token_ordering.copy_(torch.randperm(cfg.get_text_config().vocab_size,
                                                                       generator=gen))
        if agree_with is not None:
            H = cfg.backbone_hidden_size
            model.pre_projection.weight.copy_(torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1))
            for layer in model.model.layers:
                layer.post_attention_layernorm.weight.mul_(eps)
                layer.post_feedforward_layernorm.weight.mul_(eps)
            tm = _text_model(agree_with)
            model.model.norm.weight.copy_(tm.norm.weight)
            model.model.embed_tokens.weight.copy_(tm.embed_tokens.weight)
            if ordered:  # a cluster's score: the sum of its tokens' logits (its best one usually wins)
                clusters = model.masked_embedding.token_ordering.view(cfg.num_centroids, -1)
                model.masked_embedding.centroids.weight.copy_(tm.embed_tokens.weight[clusters].sum(dim=1))
    return _finish(model)


def _text_model(target):
    return target.model.language_model if hasattr(target.model, "language_model") else target.model


def bigram_target(name: str, seed: int = 0, eps: float = 0.0, norm_scale: float = 1.0):
    """build_target(name, seed) with every sub-layer's output scaled by eps, and a final norm
    weight drawn N(0, norm_scale^2): with the tied head, a weight near 1 makes every token its
    own bigram successor (output repeating one token); a random one gives varied sequences
    (norm_scale < 1: flatter distributions)."""
    model = build_target(name, seed)
    gen = torch.Generator().manual_seed(seed + 5)
    with torch.no_grad():
        norm = _text_model(model).norm.weight
        norm.copy_(torch.randn(norm.shape, generator=gen, dtype=norm.dtype) * norm_scale)
        for layer in _text_model(model).layers:
            for norm in ("post_attention_layernorm", "post_feedforward_layernorm", "post_per_layer_input_norm"):
                if hasattr(layer, norm):
                    getattr(layer, norm).weight.mul_(eps)
    return model


def all_accept_pair(name: str, seed: int = 0):
    """Target and assistant whose final norms are zero: every logit is 0, both always pick
    token 0, so every draft is accepted."""
    target, asst = build_target(name, seed), build_assistant(name, seed)
    with torch.no_grad():
        _text_model(target).norm.weight.zero_()
        asst.model.norm.weight.zero_()
    return target, asst


def all_reject_pair(name: str, seed: int = 0):
    """The assistant always drafts token 0 (zero final norm, so all its logits tie at 0) and
    the target's embedding row 0 is zero (its logit of token 0 is 0 while its largest is
    positive), so token 0 is never the target's choice and every draft is rejected."""
    target, asst = build_target(name, seed), build_assistant(name, seed)
    with torch.no_grad():
        _text_model(target).embed_tokens.weight[0].zero_()
        asst.model.norm.weight.zero_()
    return target, asst


def save(model, path) -> None:
    model.save_pretrained(str(path))


# ---- transformers' drafts ---------------------------------------------------------------------

def _generator(target, asst, k: int):
    from transformers import GenerationConfig
    from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator
    gen = SinglePositionMultiTokenCandidateGenerator(asst, target.get_input_embeddings(),
                                                     GenerationConfig(max_length=100_000))
    gen.num_assistant_tokens = k
    return gen


def _target(target, ids: list[int], cache=None):
    kw = dict(use_cache=True, output_hidden_states=True, return_shared_kv_states=True)
    if cache is not None:
        kw["cache"] = cache
    return target(input_ids=torch.tensor([ids]), **kw)


def _candidates(gen, ids: list[int], out, n_last_matches: int):
    t = torch.tensor([ids])
    cand, logits = gen.get_candidates(t, {"attention_mask": torch.ones_like(t)}, out, False, n_last_matches)
    return cand[0, len(ids):].tolist(), logits[0]


@torch.no_grad()
def greedy(target, ids: list[int], n: int) -> list[int]:
    """The target's greedy continuation (full recomputation, no cache)."""
    out = []
    for _ in range(n):
        out.append(int(target(input_ids=torch.tensor([ids + out]), use_cache=False).logits[0, -1].argmax()))
    return out


@torch.no_grad()
def drafts_after_prefill(target, asst, prompt: list[int], k: int):
    """(t, transformers' k drafts, their logits [k, vocab]) after the target prefilled
    `prompt` and chose t greedily."""
    out = _target(target, prompt)
    t = int(out.logits[0, -1].argmax())
    drafts, logits = _candidates(_generator(target, asst, k), prompt + [t], out, 0)
    return t, drafts, logits


@torch.no_grad()
def drafts_after_full_round(target, asst, prompt: list[int], k: int):
    """(the committed tokens [t, g_1..g_k, bonus], transformers' k drafts, their logits) after
    a verify step that fed [t, g_1..g_k] (t and the g's the target's greedy tokens, so every
    draft was accepted) on the prefilled prompt's cache."""
    gen = _generator(target, asst, k)
    out = _target(target, prompt)
    t = int(out.logits[0, -1].argmax())
    _candidates(gen, prompt + [t], out, 0)          # the first round (its drafts are replaced)
    g = greedy(target, prompt + [t], k)
    verify = _target(target, [t] + g, cache=out.cache)
    bonus = int(verify.logits[0, -1].argmax())
    committed = [t] + g + [bonus]
    drafts, logits = _candidates(gen, prompt + committed, verify, k)
    return committed, drafts, logits


@torch.no_grad()
def drafts_after_partial_round(target, asst, prompt: list[int], k: int, accepted: int):
    """(committed tokens, transformers' k drafts) after a verify step that fed [t, drafts]
    where only the first `accepted` drafts were the target's greedy tokens: transformers'
    drafter then reads the verify step's KV past the last accepted token (the rejected
    drafts'), which the committed context does not hold."""
    gen = _generator(target, asst, k)
    out = _target(target, prompt)
    t = int(out.logits[0, -1].argmax())
    _candidates(gen, prompt + [t], out, 0)
    g = greedy(target, prompt + [t], k)
    fed = g[:accepted] + [(g[accepted] + 1) % target.config.get_text_config().vocab_size] + g[accepted + 1:]
    verify = _target(target, [t] + fed, cache=out.cache)
    committed = [t] + fed[:accepted] + [int(verify.logits[0, accepted].argmax())]
    return committed, _candidates(gen, prompt + committed, verify, accepted)[0]


def tie_aware_equal(ours: list[int], theirs: list[int], logits: torch.Tensor, tol: float = 1e-9) -> bool:
    """Equal, or equal up to the first position where transformers' logits of the two tokens
    tie within tol (where later drafts may legitimately differ)."""
    for j, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return abs(float(logits[j, a] - logits[j, b])) < tol
    return len(ours) == len(theirs)
