"""tiny-gemma4-assistant: the Gemma 4 MTP "assistant" drafter (model_type `gemma4_assistant`)
as a training model, computing exactly what the drafter computes at inference (transformers
5.24 `Gemma4AssistantForCausalLM` driven by `SinglePositionMultiTokenCandidateGenerator`),
batched over every round position of a window.

One round drafts from position p, where t (the newest committed token) sits and whose KV is
not written yet. h starts as the target's final normed hidden state at p - 1. Each draft step:

    x = pre_projection([E_target[t] * sqrt(Hb) ; h])
    x = layers(x)          Q-only attention, RoPE at p (the same p every step of the round),
                           scale 1, over the KV of the target's last layer of the same type:
                           full layers keys 0..p-1, sliding layers the last W+1 keys p-W-1..p-1
    d = norm(x);  logits = d @ E_assistant^T  (or the centroid path);  t = argmax
    h = post_projection(d)

Rounds at different positions do not interact (their queries read only the target's KV), so
a window of T target positions gives T - 1 independent rounds (p = 1..T-1), and step k of
all of them is one batched pass (`AssistantModel.step`). Training (teacher forcing) feeds
step k the window's token at p + k - 1 and scores its prediction of the token at p + k
(`draft_losses`); the simulation feeds back its own argmax (training/gemma4_spec_sim.py).
Shapes [num_reqs, q_len, ...]: q_len rounds of each of num_reqs windows.
"""

import dataclasses
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mtpkit.step.cache import CacheTensors
from mtpkit.models.gemma4.model import Gemma4ForCausalLM, Gemma4RoPE, GemmaRMSNorm, kv_groups
from mtpkit.models.gemma4.config import FULL, SLIDING, Gemma4Config
from mtpkit.shapes import Bool, Float, Int, Tensor

NAME = "tiny-gemma4-assistant"
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "mtpkit" / "assets" / NAME

SIZES: dict[str, dict] = {
    # hidden, MLP width, layers (one of each type: each reads its own target layer's KV)
    "l2-h256": dict(hidden_size=256, intermediate_size=512, layer_types=[SLIDING, FULL], num_attention_heads=4),
    "l2-h256-i1024": dict(hidden_size=256, intermediate_size=1024, layer_types=[SLIDING, FULL],
                          num_attention_heads=4),
    "l3-h256": dict(hidden_size=256, intermediate_size=512, layer_types=[SLIDING, SLIDING, FULL],
                    num_attention_heads=4),
}
DEFAULT_SIZE = "l2-h256"


@dataclasses.dataclass(frozen=True)
class AssistantConfig:
    """What the training model needs from an assistant config.json (and the target's)."""
    vocab_size: int
    hidden_size: int
    backbone_hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float
    num_centroids: int = 0          # 0: plain tied head
    centroid_top_k: int = 0

    @classmethod
    def from_dict(cls, raw: dict) -> "AssistantConfig":
        t = raw["text_config"]
        ordered = bool(raw.get("use_ordered_embeddings"))
        return cls(int(t["vocab_size"]), int(t["hidden_size"]), int(raw["backbone_hidden_size"]),
                   int(t["intermediate_size"]), int(t["num_attention_heads"]), tuple(t["layer_types"]),
                   float(t["rms_norm_eps"]), int(raw["num_centroids"]) if ordered else 0,
                   int(raw["centroid_intermediate_top_k"]) if ordered else 0)


class TargetKV:
    """The target's KV that the assistant reads, for B windows of T positions: per layer type,
    K and V [B, T, kv_heads, head_dim] of the target's last layer of that type (after k_norm,
    RoPE and v_norm, as the target's cache holds them)."""

    def __init__(self, target: Gemma4ForCausalLM, cache: CacheTensors, B: int):
        cfg = target.cfg
        _, where = kv_groups(cfg)
        self.kv = {}
        for kind in (SLIDING, FULL):
            last = max(i for i in range(cfg.num_hidden_layers) if cfg.layer_types[i] == kind)
            group, idx = where[cfg.kv_source(last)]
            k, v = cache.kv[group][idx]
            self.kv[kind] = (k[1:B + 1], v[1:B + 1])   # request i lives in block i + 1
        self.window = cfg.sliding_window


def round_mask(p: Int[Tensor, "num_reqs q_len"], T: int, window: int | None
               ) -> Bool[Tensor, "num_reqs q_len seq_len"]:
    """Which target positions s a round at p reads: s <= p - 1, and with a window W also
    s >= p - W - 1 (the last W + 1 keys, as transformers' drafter mask |q - k| <= W)."""
    s = torch.arange(T)[None, None, :]
    m = s <= p[..., None] - 1
    if window is not None:
        m &= s >= p[..., None] - window - 1
    return m


class AssistantLayer(nn.Module):
    """A Q-only Gemma 4 decoder layer: norm -> q_proj -> q_norm -> RoPE -> attention over the
    target's K/V -> o_proj -> norm -> +res -> norm -> gelu-tanh MLP -> norm -> +res -> times
    layer_scalar."""

    def __init__(self, c: AssistantConfig, kind: str, head_dim: int, rope):
        super().__init__()
        H, eps = c.hidden_size, c.rms_norm_eps
        self.kind, self.heads, self.hd = kind, c.num_attention_heads, head_dim
        self.q_proj = nn.Linear(H, self.heads * head_dim, bias=False)
        self.q_norm = GemmaRMSNorm(head_dim, eps)
        self.o_proj = nn.Linear(self.heads * head_dim, H, bias=False)
        self.gate_proj = nn.Linear(H, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(H, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, H, bias=False)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, GemmaRMSNorm(H, eps))
        self.layer_scalar = nn.Parameter(torch.ones(1))
        self.rope = Gemma4RoPE(head_dim, rope.theta, rope.partial_rotary_factor, rope.proportional)

    def forward(self, x: Float[Tensor, "num_reqs q_len hidden"], p: Int[Tensor, "num_reqs q_len"],
                kv: tuple[Tensor, Tensor], mask: Bool[Tensor, "num_reqs q_len seq_len"]
                ) -> Float[Tensor, "num_reqs q_len hidden"]:
        B, Q, _ = x.shape
        q = self.q_norm(self.q_proj(self.input_layernorm(x)).view(B * Q, self.heads, self.hd))
        q = self.rope(p.reshape(-1), q).view(B, Q, self.heads, self.hd).transpose(1, 2)
        k, v = (t.transpose(1, 2) for t in kv)                              # [B, kv_heads, T, hd]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=1.0,
                                           enable_gqa=self.heads != k.shape[1])
        x = x + self.post_attention_layernorm(self.o_proj(o.transpose(1, 2).reshape(B, Q, -1)))
        h = self.pre_feedforward_layernorm(x)
        h = self.down_proj(F.gelu(self.gate_proj(h), approximate="tanh") * self.up_proj(h))
        return (x + self.post_feedforward_layernorm(h)) * self.layer_scalar


class AssistantModel(nn.Module):
    def __init__(self, c: AssistantConfig, target_cfg: Gemma4Config):
        super().__init__()
        self.cfg = c
        if c.backbone_hidden_size != target_cfg.hidden_size or c.vocab_size != target_cfg.vocab_size:
            raise ValueError("the assistant's backbone_hidden_size and vocab_size must equal the target's")
        geometry = {t: target_cfg.head_dims[target_cfg.layer_types.index(t)] for t in (SLIDING, FULL)}
        self.embed_tokens = nn.Parameter(torch.empty(c.vocab_size, c.hidden_size))   # the tied output head
        self.layers = nn.ModuleList([AssistantLayer(c, t, geometry[t], target_cfg.rope[t]) for t in c.layer_types])
        self.norm = GemmaRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.pre_projection = nn.Linear(2 * c.backbone_hidden_size, c.hidden_size, bias=False)
        self.post_projection = nn.Linear(c.hidden_size, c.backbone_hidden_size, bias=False)
        self.centroids = nn.Linear(c.hidden_size, c.num_centroids, bias=False) if c.num_centroids else None
        self.register_buffer("token_ordering", torch.arange(c.vocab_size), persistent=True)
        for m in self.modules():
            if isinstance(m, GemmaRMSNorm):
                m.weight.requires_grad_(True)

    def step(self, e: Float[Tensor, "num_reqs q_len backbone_hidden"], h: Float[Tensor, "num_reqs q_len backbone_hidden"],
             p: Int[Tensor, "num_reqs q_len"], kv: TargetKV, masks: dict
             ) -> tuple[Float[Tensor, "num_reqs q_len hidden"], Float[Tensor, "num_reqs q_len backbone_hidden"]]:
        """One draft step of every round: (d = the final normed state, the next h)."""
        x = self.pre_projection(torch.cat([e, h], dim=-1))
        for layer in self.layers:
            x = layer(x, p, kv.kv[layer.kind], masks[layer.kind])
        d = self.norm(x)
        return d, self.post_projection(d)

    def logits(self, d: Float[Tensor, "... hidden"]) -> Float[Tensor, "... vocab"]:
        """The tied head's logits (no softcapping)."""
        return d @ self.embed_tokens.t()

    def centroid_logits(self, d: Float[Tensor, "... hidden"]) -> Float[Tensor, "... vocab"]:
        """transformers' masked embedding: the tokens of the top-k centroids get their tied-head
        logit, every other token (the minimum of the selected logits) - 1."""
        C, V = self.cfg.num_centroids, self.cfg.vocab_size
        top = torch.topk(self.centroids(d), self.cfg.centroid_top_k, dim=-1).indices     # [..., k]
        cand = self.token_ordering.view(C, V // C)[top].flatten(-2)                     # [..., k * V/C]
        sel = (d.unsqueeze(-2) @ self.embed_tokens[cand].transpose(-1, -2)).squeeze(-2)
        out = torch.full(d.shape[:-1] + (V,), sel.min().item() - 1.0, dtype=d.dtype)
        return out.scatter(-1, cand, sel)

    def draft_logits(self, d: Float[Tensor, "... hidden"]) -> Float[Tensor, "... vocab"]:
        """The logits whose argmax is the draft (centroid path when the config has centroids)."""
        return self.centroid_logits(d) if self.cfg.num_centroids else self.logits(d)


def rounds_input(target: Gemma4ForCausalLM, hidden: Float[Tensor, "num_tokens backbone_hidden"],
                 cache: CacheTensors, B: int, T: int, p: Int[Tensor, "num_reqs q_len"]):
    """(h for step 1 = the target's hidden at p - 1, the target's KV, masks per layer type)."""
    h0 = hidden.view(B, T, -1).gather(1, (p - 1)[..., None].expand(-1, -1, hidden.shape[-1]))
    kv = TargetKV(target, cache, B)
    masks = {FULL: round_mask(p, T, None), SLIDING: round_mask(p, T, kv.window)}
    return h0, kv, masks


def draft_losses(asst: AssistantModel, target: Gemma4ForCausalLM, batch: Int[Tensor, "num_reqs seq_len"], T: int,
                 depth: int, distill: float, queries: int | None, g: torch.Generator | None) -> list[Tensor]:
    """Teacher-forced losses of draft steps 1..depth over rounds at positions p of a batch
    [B, >= T + depth] (the target runs on its first T tokens, without gradients).

    Step k of the round at p reads the token at p + k - 1 and predicts the token at p + k:
    (1 - distill) x cross-entropy to that token + distill x cross-entropy to the target's own
    distribution over it (its logits at p + k - 1; a greedy draft is accepted when it equals
    the target's argmax). Rounds at p = 1..T-k are scored at step k; `queries` rounds per
    window are drawn at random (all T - 1 when None)."""
    from training.gemma4_target import run_target

    B = batch.shape[0]
    with torch.no_grad():
        hidden, tlogits, cache = run_target(target, batch[:, :T])
        soft = torch.softmax(tlogits.float().view(B, T, -1), -1)
    if queries is None or queries >= T - 1:
        p = torch.arange(1, T).expand(B, -1)
    else:
        p = torch.stack([torch.randperm(T - 1, generator=g)[:queries] + 1 for _ in range(B)]).sort(-1).values
    h, kv, masks = rounds_input(target, hidden, cache, B, T, p)
    losses = []
    for k in range(1, depth + 1):
        tok = batch.gather(1, p + k - 1)
        with torch.no_grad():
            e = target.embed(tok.reshape(-1)).view(B, -1, hidden.shape[-1])
        d, h = asst.step(e, h, p, kv, masks)
        valid = p + k - 1 <= T - 1
        logp = torch.log_softmax(asst.logits(d).float(), -1)[valid]                    # [n, V]
        data = -logp.gather(-1, batch.gather(1, p + k)[valid][:, None]).mean()
        if distill > 0:
            want = soft.gather(1, (p + k - 1).clamp(max=T - 1)[..., None].expand(-1, -1, soft.shape[-1]))[valid]
            losses.append((1 - distill) * data - distill * (want * logp).sum(-1).mean())
        else:
            losses.append(data)
    return losses


@torch.no_grad()
def evaluate(a: AssistantModel, target: Gemma4ForCausalLM, windows: Int[Tensor, "num_reqs seq_len"], T: int,
             depth: int, batch: int) -> dict:
    """Teacher-forced, over every round of fixed windows [N, >= T + depth]: how often draft
    step k's argmax (draft_logits) equals the target's greedy token at p + k (its argmax at
    p + k - 1), per step; and step 1's agreement through the plain tied head."""
    from training.gemma4_target import run_target

    agree, n = [0] * depth, [0] * depth
    plain1 = 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i:i + batch]
        B = w.shape[0]
        hidden, tlogits, cache = run_target(target, w[:, :T])
        greedy = tlogits.argmax(-1).view(B, T)
        p = torch.arange(1, T).expand(B, -1)
        h, kv, masks = rounds_input(target, hidden, cache, B, T, p)
        for k in range(1, depth + 1):
            e = target.embed(w.gather(1, p + k - 1).reshape(-1)).view(B, T - 1, -1)
            d, h = a.step(e, h, p, kv, masks)
            valid = p + k - 1 <= T - 1
            want = greedy.gather(1, (p + k - 1).clamp(max=T - 1))
            agree[k - 1] += (a.draft_logits(d).argmax(-1) == want)[valid].sum().item()
            n[k - 1] += valid.sum().item()
            if k == 1:
                plain1 += (a.logits(d).argmax(-1) == want)[valid].sum().item()
    out = {f"agree{k + 1}": agree[k] / n[k] for k in range(depth)}
    if a.cfg.num_centroids:
        out["agree1_plain_head"] = plain1 / n[0]
    return out
