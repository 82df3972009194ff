"""The Gemma 4 assistant (model_type `gemma4_assistant`): a small decoder whose layers have
no K/V of their own. Each draft step maps [E_target[t] * sqrt(Hb); h] to its hidden size
(`pre_projection`), runs Q-only Gemma 4 layers that attend over the TARGET's KV cache (each
layer the KV of the target layer it maps to, `kv_at`), normalises, scores the vocabulary
with its tied embeddings (or the centroid head) and maps back to the target's width
(`post_projection`) for the next step. The drafter (speculative/gemma4_assistant.py) runs
the steps; transformers 5.24's `transformers.models.gemma4` assistant is the oracle.
"""

import torch
from torch import nn

from mtpkit.kernels.ops import Ops
from mtpkit.step.cache import CacheTensors
from mtpkit.parallel import TP
from mtpkit.shapes import Float, Int, Tensor, checked, shaped_dataclass
from mtpkit.models.family import FamilyModel
from mtpkit.models.gemma4.model import GeluMLP, Gemma4RoPE, GemmaRMSNorm
from mtpkit.models.gemma4.assistant_config import Gemma4AssistantConfig
from mtpkit.models.gemma4.config import Gemma4Config
from mtpkit.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear, vocab_parallel_logits
from mtpkit.checkpoint.weights import WeightSpec, read
from mtpkit.sampling.bitmask import DraftMask


@shaped_dataclass(frozen=True)
class KVRead:
    """How one round's queries read one target KV group: row i's query sees keys before
    seq_lens[i] (= p, the position of the newest committed token, whose KV is not written),
    through the group's block table; `kv_slots` is the torch attention's gather of those
    positions, clamped to the ones the round reads."""

    seq_lens: Int[Tensor, "num_reqs_padded"]
    block_table: Int[Tensor, "num_reqs_padded max_blocks"]
    kv_slots: Int[Tensor, "num_reqs_padded ctx_len"]
    max_seq_len: int


class QOnlyAttention(nn.Module):
    """q_proj, q_norm, RoPE (at the round position p), scale 1 over the target layer's cache
    entry; no k/v projections. Full layers see keys 0..p-1; sliding layers the last W + 1,
    p-W-1..p-1 (transformers' drafter mask is |q - k| <= W, one key wider than the target's
    own window), so the attention window is W + 1 with the query masked as if at p - 1."""

    def __init__(self, cfg: Gemma4Config, i: int, kv_at: tuple[str, int], tp: TP, ops: Ops):
        super().__init__()
        self.ops, self.kv_group, self.kv_index = ops, *kv_at
        hd, H = cfg.head_dims[i], cfg.hidden_size
        self.hd = hd
        self.heads = tp.split(cfg.num_attention_heads, what="num_attention_heads")
        w = cfg.window(i)
        self.window = None if w is None else w + 1
        self.q_proj = ColumnParallelLinear(H, cfg.num_attention_heads * hd, tp, block=hd)
        self.q_norm = GemmaRMSNorm(hd, cfg.rms_norm_eps)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * hd, H, tp)
        rope = cfg.rope[cfg.layer_types[i]]
        self.rope = Gemma4RoPE(hd, rope.theta, rope.partial_rotary_factor, rope.proportional)

    @checked
    def forward(self, x: Float[Tensor, "num_reqs_padded hidden"], positions: Int[Tensor, "num_reqs_padded"],
                kv: KVRead, cache: CacheTensors) -> Float[Tensor, "num_reqs_padded hidden"]:
        R, hq, hd = x.shape[0], self.heads, self.hd
        q = self.rope(positions, self.q_norm(self.q_proj(x).view(R, hq, hd)))
        k_cache, v_cache = cache.kv[self.kv_group][self.kv_index]
        o = self.ops.paged_attention_verify(q.view(R, 1, hq, hd), k_cache, v_cache, kv.seq_lens, kv.block_table, 1.0,
                                            sliding_window=self.window, max_seq_len=kv.max_seq_len,
                                            kv_slots=kv.kv_slots)
        return self.o_proj(o.reshape(R, hq * hd))


class AssistantLayer(nn.Module):
    """Gemma 4's decoder layer around a Q-only attention: norm -> attn -> norm -> +res ->
    norm -> gelu MLP -> norm -> +res -> times layer_scalar."""

    def __init__(self, cfg: Gemma4Config, i: int, kv_at: tuple[str, int], tp: TP, ops: Ops):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = QOnlyAttention(cfg, i, kv_at, tp, ops)
        self.mlp = GeluMLP(H, cfg.intermediate_size, tp)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, GemmaRMSNorm(H, eps))
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)

    @checked
    def forward(self, x: Float[Tensor, "num_reqs_padded hidden"], positions: Int[Tensor, "num_reqs_padded"],
                kv: KVRead, cache: CacheTensors) -> Float[Tensor, "num_reqs_padded hidden"]:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), positions, kv, cache))
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x * self.layer_scalar


class MaskedEmbedding(nn.Module):
    """The ordered-embedding head: the top-k clusters of `centroids(d)` name the candidate
    tokens (token_ordering viewed [centroids, vocab / centroids]), which alone are scored
    against the tied embedding rows. transformers gives every other token (the smallest
    selected logit) - 1; only the argmax is needed here, which is the best candidate (the
    smallest id among equal ones, as argmax over transformers' full row picks)."""

    def __init__(self, cfg: Gemma4AssistantConfig, tp: TP):
        super().__init__()
        self.tp, self.vocab, self.num_centroids = tp, cfg.vocab_size, cfg.num_centroids
        self.top_k = cfg.centroid_intermediate_top_k
        self.centroids = Linear(cfg.hidden_size, cfg.num_centroids, tp)      # replicated (small)
        # A permutation of the vocabulary, integer: loaded as stored (never cast to the model dtype).
        self.token_ordering = nn.Parameter(torch.zeros(cfg.vocab_size, dtype=torch.int64), requires_grad=False)

    def checkpoint_specs(self, prefix: str) -> list[WeightSpec]:
        name = prefix + ".token_ordering"
        return [WeightSpec(self.token_ordering, {name: (self.vocab,)}, lambda t: read(t[name]), lambda w: {name: w},
                           keep_dtype=True)]

    @checked
    def argmax(self, d: Float[Tensor, "num_reqs_padded hidden"], embed: Float[Tensor, "vocab_shard hidden"]
               ) -> Int[Tensor, "num_reqs_padded"]:
        R, tp = d.shape[0], self.tp
        top = self.centroids(d).topk(self.top_k, dim=-1).indices                               # [R, k]
        cand = self.token_ordering.view(self.num_centroids, -1)[top].reshape(R, -1)            # [R, candidates]
        rows = cand
        if tp.size > 1:  # each rank scores the candidates it holds, zeros elsewhere, summed (exact)
            part = embed.shape[0]
            rows = cand - tp.rank * part
            outside = (rows < 0) | (rows >= part)
            rows = rows.clamp(0, part - 1)
        scores = torch.bmm(embed[rows], d[:, :, None])[..., 0]                                 # [R, candidates]
        if tp.size > 1:
            scores = tp.all_reduce(scores.masked_fill(outside, 0.0))
        best = scores.max(dim=-1, keepdim=True).values
        # The clamp: a row whose scores are NaN (no candidate equals the max; e.g. a padded row
        # over a poisoned null block) still drafts an id in range, as argmax would.
        return torch.where(scores == best, cand, self.vocab).min(dim=-1).values.clamp(max=self.vocab - 1)


class Gemma4Assistant(FamilyModel):
    """The assistant's weights and one draft step. `kv_at`: layer type -> (target KV group,
    index in it) of the target layer its layers of that type read."""

    def __init__(self, cfg: Gemma4AssistantConfig, ops: Ops, tp: TP | None = None, *,
                 kv_at: dict[str, tuple[str, int]]):
        super().__init__()
        tp = tp or TP.single()
        self.cfg, self.tp, self.ops = cfg, tp, ops
        text, H, Hb = cfg.text, cfg.hidden_size, cfg.backbone_hidden_size
        self.embed_tokens = nn.Parameter(torch.empty(-(-cfg.vocab_size // tp.size), H), requires_grad=False)
        self.lm_head = None                                                   # tied: embed_tokens
        self.layers = nn.ModuleList([AssistantLayer(text, i, kv_at[text.layer_types[i]], tp, ops)
                                     for i in range(text.num_hidden_layers)])
        self.norm = GemmaRMSNorm(H, text.rms_norm_eps)
        self.pre_projection = Linear(2 * Hb, H, tp)                           # replicated (small)
        self.post_projection = Linear(H, Hb, tp)
        self.masked_embedding = MaskedEmbedding(cfg, tp) if cfg.use_ordered_embeddings else None

    @staticmethod
    def tensor_parallel_problems(cfg: Gemma4AssistantConfig, size: int) -> list[str]:
        """What `size` ranks cannot split, one line each (config.json alone)."""
        t = cfg.text
        return [f"the assistant's {name}={n} is not divisible by {size}" for name, n in
                (("num_attention_heads", t.num_attention_heads), ("intermediate_size", t.intermediate_size))
                if size > 1 and n % size]

    def kv_reads(self) -> dict[str, int | None]:
        """Target KV group -> the attention window its readers use (None: full)."""
        return {layer.self_attn.kv_group: layer.self_attn.window for layer in self.layers}

    # ---- checkpoint names and layout ------------------------------------------------------
    def checkpoint_name(self, param_name: str) -> str:
        if param_name.startswith(("pre_projection", "post_projection", "masked_embedding", "lm_head")):
            return param_name
        return "model." + param_name

    # set_weight_layout: FamilyModel's; the embedding table, whose rows the centroid head
    # gathers, stays row-major (FamilyModel.row_major).

    def dummy_value(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """Random weights: plain-weight norms and layer scalars start at 1; token_ordering is
        the identity permutation."""
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "token_ordering":
            return torch.arange(shape[0])
        if ("norm" in name and leaf == "weight") or leaf == "layer_scalar":
            return torch.ones(shape)
        return None

    # ---- one draft step ----------------------------------------------------------------
    @checked
    def step(self, embedded: Float[Tensor, "num_reqs_padded backbone_hidden"],
             h: Float[Tensor, "num_reqs_padded backbone_hidden"], positions: Int[Tensor, "num_reqs_padded"],
             kv: dict[str, KVRead], cache: CacheTensors, mask: DraftMask | None = None
             ) -> tuple[Int[Tensor, "num_reqs_padded"], Float[Tensor, "num_reqs_padded backbone_hidden"]]:
        """(argmax draft, next step's h) from the scaled target embedding of the newest token
        and the previous h (embedding first, as transformers concatenates them). `mask`: the
        constrained rows' grammar masks; their argmax is over the tokens it allows."""
        dt = self.embed_tokens.dtype   # its own (EngineArgs.draft_dtype); the target's embedding comes in the target's
        x = self.pre_projection(torch.cat([embedded.to(dt), h.to(dt)], dim=-1))
        for layer in self.layers:
            x = layer(x, positions, kv[layer.self_attn.kv_group], cache)
        d = self.norm(x)
        if self.masked_embedding is None or mask is not None:   # no final softcapping in the assistant
            logits = vocab_parallel_logits(d, self.embed_tokens, self.tp, self.cfg.vocab_size)
            token = (logits if mask is None else mask.apply_(logits)).argmax(dim=-1)
        if self.masked_embedding is not None:
            sparse = self.masked_embedding.argmax(d, self.embed_tokens)
            # A constrained row scores the whole vocabulary: the centroids' candidates may hold
            # no token its grammar allows. The other rows keep the centroid head's draft.
            token = sparse if mask is None else sparse.index_copy(0, mask.rows, token[mask.rows])
        return token, self.post_projection(d)
