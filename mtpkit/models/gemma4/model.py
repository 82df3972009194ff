"""Gemma 4's text decoder: sliding and full attention layers with per-layer geometry, dense
gelu-tanh MLP or MLP + MoE, per-layer embeddings (E2B/E4B), KV-shared layers.

Written against the kernels (mtpkit.kernels.ops.Ops) and the cache storage passed in, like
Qwen3-Next's model. transformers 5.24 is the oracle for its logits (where the two disagree, transformers' behaviour is what is implemented).
"""

import torch
import torch.nn.functional as F
from torch import nn

from mtpkit.kernels.ops import Ops
from mtpkit.step.metadata import PrefillMetadata, UniformMetadata
from mtpkit.step.cache import CacheTensors
from mtpkit.step.cache_spec import CacheSpec, KVGroup
from mtpkit.errors import ConfigError
from mtpkit.parallel import TP
from mtpkit.shapes import Float, Int, Tensor, checked
from mtpkit.kernels import elementwise
from mtpkit.models.family import FamilyModel
from mtpkit.models.gemma4.config import FULL, Gemma4Config, kv_source_of_type
from mtpkit.layers.mlp import MLP
from mtpkit.layers.linear import (ColumnParallelLinear, Linear, MergedColumnParallelLinear, RowParallelLinear,
                                  vocab_parallel_embedding, vocab_parallel_logits)
from mtpkit.layers.rope import PartialRoPE
from mtpkit.layers.moe import SparseMoE
from mtpkit.layers.moe_fp8 import MoENames
from mtpkit.checkpoint.weights import WeightSpec, narrow, read, shard_range

Metadata = PrefillMetadata | UniformMetadata

# Tensors of the multimodal checkpoint (model_type gemma4) that a text-only decoder never reads.
TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")


def _local_kv_heads(kv: int, tp_size: int) -> int:
    # Split across ranks, or one (replicated) head per rank when there are fewer than ranks.
    return max(1, kv // tp_size)


def kv_groups(cfg: Gemma4Config, tp_size: int = 1) -> tuple[list[KVGroup], dict[int, tuple[str, int]]]:
    """One paged KV group per distinct (KV heads, head_dim, window) among the layers that
    compute their KV, and where each layer's KV lives: layer -> (group, index in group).
    A KV-shared layer points at its source layer's entry and owns none."""
    counts: dict[tuple, int] = {}
    where: dict[int, tuple[str, int]] = {}
    for i in range(cfg.first_shared_layer):
        key = (_local_kv_heads(cfg.kv_heads[i], tp_size), cfg.head_dims[i], cfg.window(i))
        name = f"{'sliding' if key[2] else 'full'}_kv{key[0]}_d{key[1]}"
        where[i] = (name, counts.get(key, 0))
        counts[key] = counts.get(key, 0) + 1
    for i in range(cfg.first_shared_layer, cfg.num_hidden_layers):
        where[i] = where[cfg.kv_source(i)]
    groups = [KVGroup(f"{'sliding' if w else 'full'}_kv{k}_d{d}", n, k, d, w) for (k, d, w), n in counts.items()]
    return groups, where


def check_tensor_parallel(cfg: Gemma4Config, size: int) -> None:
    """ConfigError naming every dimension `size` ranks cannot split (config.json alone)."""
    if size < 2:
        return
    need = {"num_attention_heads": cfg.num_attention_heads, "intermediate_size": cfg.intermediate_size}
    if cfg.enable_moe_block:
        need["num_experts"] = cfg.num_experts           # whole experts per rank
    problems = [f"{name}={n} is not divisible by {size}" for name, n in need.items() if n % size]
    for kv in sorted(set(cfg.kv_heads)):
        if kv % size and size % kv:
            problems.append(f"num_key_value_heads={kv} neither divides nor is divisible by {size}")
    if problems:
        raise ConfigError(f"tensor_parallel_size={size} cannot split this model: " + "; ".join(problems)
                          + "; choose a tensor_parallel_size that divides all of them")


class GemmaRMSNorm(nn.Module):
    """Gemma 4's RMSNorm: x * (mean(x^2) + eps)^-0.5 * w with a plain weight (initialised to 1,
    not Qwen's 1 + w), in fp32 at least; `with_scale=False` has no weight (v_norm, the router's
    norm). Shape-polymorphic over the last dim, like layers.RMSNorm."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.eps, self.normalized_dim = eps, dim
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False) if with_scale else None

    def forward(self, x: Tensor) -> Tensor:   # any leading dims (hidden states, heads)
        return elementwise.norm_last_dim(x, self.weight, self.eps, False)

    def scale(self, dtype: torch.dtype) -> Tensor:
        """The weight in `dtype` (ones without one)."""
        if self.weight is None:
            return torch.ones(self.normalized_dim, dtype=dtype)
        return self.weight if self.weight.dtype == dtype else self.weight.to(dtype)


class Gemma4RoPE(PartialRoPE):
    """rotate_half RoPE over the whole head. "default": head_dim/2 frequencies
    theta^(-2j/head_dim); "proportional": the first int(factor * head_dim // 2) of those
    (still over the denominator head_dim) and zeros for the rest (cos 1, sin 0)."""

    def __init__(self, head_dim: int, theta: float, partial_rotary_factor: float, proportional: bool):
        super().__init__(head_dim, head_dim, theta)
        if proportional:
            angles = int(partial_rotary_factor * head_dim // 2)
            inv = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim))
            inv = torch.cat([inv, torch.zeros(head_dim // 2 - angles)])
            self.inv_freq_full = torch.cat([inv, inv])


class GeluMLP(MLP):
    """down(gelu_tanh(gate(x)) * up(x)), gate and up merged (layers.MLP with Gemma's activation)."""

    act = "gelu_tanh"


class Gemma4Experts(SparseMoE):
    """The routed experts of a MoE layer: SparseMoE's three execution paths (no shared
    expert; the dense MLP beside them is the layer's own `mlp`) with gelu-tanh experts and
    Gemma's routing: softmax over all experts in fp32, top-k, renormalised, times the chosen
    experts' `per_expert_scale`. The router's input differs from the experts' (see forward),
    so the router projection (w_in) is applied to it separately."""

    act = "gelu_tanh"
    merge_inputs = False   # the router reads router_x, the experts x

    def __init__(self, cfg: Gemma4Config, tp: TP, ops: Ops | None = None):
        super().__init__(cfg.hidden_size, cfg.num_experts, cfg.top_k_experts, cfg.moe_intermediate_size, 0,
                         True, tp, ops)
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts), requires_grad=False)

    def moe_names(self, prefix: str, fp8_names) -> MoENames:
        layer = prefix.rpartition(".")[0]
        return MoENames(router=f"{layer}.router.proj.weight", experts=f"{layer}.experts", fused=True)

    def plain_specs(self, prefix: str) -> list[WeightSpec]:
        """router.proj.weight [E, H] and router.per_expert_scale [E] (replicated: every rank
        routes alike); experts.gate_up_proj [E, 2I, H] (gate rows first) and
        experts.down_proj [E, H, I], of which this rank reads its whole experts."""
        layer = prefix.rpartition(".")[0]
        E, I, H, nl = self.num_experts, self.inter, self.hidden, self.num_local
        proj, gu, down = f"{layer}.router.proj.weight", f"{layer}.experts.gate_up_proj", f"{layer}.experts.down_proj"
        pes = f"{layer}.router.per_expert_scale"
        return [
            WeightSpec(self.w_in, {proj: (E, H)}, lambda t: read(t[proj]), lambda w: {proj: w}),
            WeightSpec(self.per_expert_scale, {pes: (E,)}, lambda t: read(t[pes]), lambda w: {pes: w}),
            WeightSpec(self.w13, {gu: (E, 2 * I, H)}, lambda t: narrow(t[gu], 0, self.first, nl),
                       lambda w: {gu: w}),
            # w_out [H, local * I]: expert e's down matrix [H, I] as columns e*I ... (e+1)*I - 1.
            WeightSpec(self.w_out, {down: (E, H, I)},
                       lambda t: narrow(t[down], 0, self.first, nl).permute(1, 0, 2).reshape(H, nl * I),
                       lambda w: {down: w.reshape(H, nl, I).permute(1, 0, 2).contiguous()})]

    @checked
    def route(self, logits: Float[Tensor, "num_tokens experts"]) -> tuple[
            Float[Tensor, "num_tokens topk"], Int[Tensor, "num_tokens topk"]]:
        weights, experts = super().route(logits)
        weights = weights * self.per_expert_scale[experts].to(weights.dtype)
        return weights, experts

    @checked
    def forward(self, x: Float[Tensor, "num_tokens hidden"], router_x: Float[Tensor, "num_tokens hidden"]
                ) -> Float[Tensor, "num_tokens hidden"]:
        return self._experts(x, self.project_in(router_x))     # router logits [T, E]


class Router(nn.Module):
    """The router's input: RMSNorm without weight, times router.scale [hidden] and hidden^-0.5.
    Its projection and per_expert_scale live in Gemma4Experts (w_in, per_expert_scale)."""

    def __init__(self, cfg: Gemma4Config):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(cfg.hidden_size), requires_grad=False)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, with_scale=False)
        self.root = cfg.hidden_size ** -0.5

    @checked
    def forward(self, r: Float[Tensor, "num_tokens hidden"]) -> Float[Tensor, "num_tokens hidden"]:
        return self.norm(r) * self.scale * self.root


class Attention(nn.Module):
    """q/k norms, RoPE of the layer's type, v_norm (no weight), scale 1, paged KV with the
    layer's window. A layer with `attention_k_eq_v` (full layers) has no v_proj: V is the raw
    k_proj output through v_norm. A KV-shared layer has only q_proj, q_norm and o_proj and
    reads its source layer's cache entry."""

    def __init__(self, cfg: Gemma4Config, i: int, kv_at: tuple[str, int], tp: TP, ops: Ops):
        super().__init__()
        self.ops, self.kv_group, self.kv_index = ops, *kv_at
        hd, kv, H = cfg.head_dims[i], cfg.kv_heads[i], cfg.hidden_size
        self.hd, self.window = hd, cfg.window(i)
        self.shared = i >= cfg.first_shared_layer
        self.k_eq_v = cfg.attention_k_eq_v and cfg.layer_types[i] == FULL
        self.heads = tp.split(cfg.num_attention_heads, what="num_attention_heads")
        self.kv_heads = shard_range(kv * hd, hd, tp, "k_proj", replicate=True)[1] // hd
        q_rows = cfg.num_attention_heads * hd
        if self.shared:
            self.q_proj = ColumnParallelLinear(H, q_rows, tp, block=hd)
        else:
            parts = [("q_proj", q_rows, hd, False), ("k_proj", kv * hd, hd, True)]
            if not self.k_eq_v:
                parts.append(("v_proj", kv * hd, hd, True))
            self.qkv_proj = MergedColumnParallelLinear(H, parts, tp)
            self.k_norm = GemmaRMSNorm(hd, cfg.rms_norm_eps)
            self.v_norm = GemmaRMSNorm(hd, cfg.rms_norm_eps, with_scale=False)
        self.q_norm = GemmaRMSNorm(hd, cfg.rms_norm_eps)
        self.o_proj = RowParallelLinear(q_rows, H, tp)
        rope = cfg.rope[cfg.layer_types[i]]
        self.rope = Gemma4RoPE(hd, rope.theta, rope.partial_rotary_factor, rope.proportional)

    @checked
    def forward(self, x: Float[Tensor, "num_tokens hidden"], positions: Int[Tensor, "num_tokens"], meta: Metadata,
                cache: CacheTensors, cos_sin: tuple[Tensor, Tensor] | None = None,
                kv_gather: tuple[Tensor, Tensor | None] | None = None) -> Float[Tensor, "num_tokens hidden"]:
        """`cos_sin`: this layer type's RoPE angles at `positions` (self.rope.cos_sin), and
        `kv_gather`: a uniform step's KV slots and positions in this layer's pool
        (ops.verify_gather), when the model computed them once for all its layers."""
        hq, hkv, hd = self.heads, self.kv_heads, self.hd
        k_cache, v_cache = cache.kv[self.kv_group][self.kv_index]
        pool = cache.pool_index[self.kv_group]
        cos, sin = self.rope.cos_sin(positions) if cos_sin is None else cos_sin
        if self.shared:
            q = self.rope.rotate(self.q_norm(self.q_proj(x).view(-1, hq, hd)), cos, sin)
        else:
            q, k, v = self._qkv(x, cos, sin)
            self.ops.write_kv(k, v, k_cache, v_cache, meta.slot_mappings[pool])
        if isinstance(meta, PrefillMetadata):
            o = self.ops.paged_attention_prefill(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens,
                                                 meta.block_tables[pool], 1.0, sliding_window=self.window)
        else:
            kv_slots, kv_pos = (None if meta.kv_slots is None else meta.kv_slots[pool], None) if kv_gather is None \
                else kv_gather
            o = self.ops.paged_attention_verify(q.view(meta.num_reqs_padded, meta.q_len, hq, hd), k_cache, v_cache,
                                                meta.seq_lens, meta.block_tables[pool], 1.0,
                                                sliding_window=self.window, max_seq_len=meta.max_seq_len,
                                                kv_slots=kv_slots, kv_pos=kv_pos)
        return self.o_proj(o.reshape(-1, hq * hd))


    @checked
    def _qkv(self, x: Float[Tensor, "num_tokens hidden"], cos: Float[Tensor, "num_tokens 1 head_dim"],
             sin: Float[Tensor, "num_tokens 1 head_dim"]) -> tuple[
            Float[Tensor, "num_tokens heads head_dim"], Float[Tensor, "num_tokens kv_heads head_dim"],
            Float[Tensor, "num_tokens kv_heads head_dim"]]:
        """q, k (normed, rotated) and v (normed) of every token. The heads [q | k | v] (with
        k_eq_v [q | k]: V is the raw k) are normalised in one op, the same arithmetic as q_norm,
        k_norm and v_norm apply one by one (rms_norm multiplies by its weight last), and q and k
        are scaled and rotated together: a third of the ops, at decode sizes where each op's
        dispatch is most of its cost."""
        hq, hkv, hd = self.heads, self.kv_heads, self.hd
        heads = self.qkv_proj(x).view(x.shape[0], -1, hd)
        xf = heads if heads.dtype in (torch.float32, torch.float64) else heads.float()
        normed = F.rms_norm(xf, (hd,), None, self.q_norm.eps)
        scale = torch.cat([self.q_norm.scale(xf.dtype).expand(hq, hd), self.k_norm.scale(xf.dtype).expand(hkv, hd)])
        qk = self.rope.rotate(elementwise.cast(normed[:, :hq + hkv] * scale, x.dtype), cos, sin)
        v = normed[:, hq:hq + hkv] if self.k_eq_v else normed[:, hq + hkv:]
        return qk[:, :hq], qk[:, hq:], elementwise.cast(v, x.dtype)


class DecoderLayer(nn.Module):
    """norm -> attn -> norm -> +res -> norm -> MLP (+ MoE, each with its own norms) -> norm
    -> +res -> (per-layer embedding block) -> times layer_scalar."""

    def __init__(self, cfg: Gemma4Config, i: int, kv_at: tuple[str, int], tp: TP, ops: Ops):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.ops, self.eps = ops, eps
        self.self_attn = Attention(cfg, i, kv_at, tp, ops)
        self.mlp = GeluMLP(H, cfg.intermediate(i), tp, ops)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, GemmaRMSNorm(H, eps))
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)   # a saved buffer in HF
        self.moe = cfg.enable_moe_block
        if self.moe:
            self.router = Router(cfg)
            self.experts = Gemma4Experts(cfg, tp, ops)
            for name in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2"):
                setattr(self, name, GemmaRMSNorm(H, eps))
        self.ple = cfg.hidden_size_per_layer_input > 0
        if self.ple:
            Dp = cfg.hidden_size_per_layer_input
            self.per_layer_input_gate = Linear(H, Dp, tp)        # replicated (small)
            self.per_layer_projection = Linear(Dp, H, tp)
            self.post_per_layer_input_norm = GemmaRMSNorm(H, eps)

    @checked
    def forward(self, x: Float[Tensor, "num_tokens hidden"], ple: Float[Tensor, "num_tokens ple_dim"] | None,
                positions: Int[Tensor, "num_tokens"], meta: Metadata, cache: CacheTensors,
                cos_sin: tuple[Tensor, Tensor] | None = None, kv_gather: tuple | None = None
                ) -> Float[Tensor, "num_tokens hidden"]:
        # The norms around the two residual adds are the backend's fused glue (elementwise.py):
        # x + post_attention_layernorm(a) and pre_feedforward_layernorm of that sum in one op,
        # x + post_feedforward_layernorm(h) (times layer_scalar unless the PLE block follows) in one.
        ops, eps = self.ops, self.eps
        a = self.self_attn(ops.rms_norm(x, self.input_layernorm.weight, eps, False), positions, meta, cache,
                           cos_sin, kv_gather)
        h, x = ops.norm_add_rms_norm(a, x, self.post_attention_layernorm.weight, self.pre_feedforward_layernorm.weight,
                                     eps)
        h = self.mlp(h)
        if self.moe:
            routed = self.experts(self.pre_feedforward_layernorm_2(x), self.router(x))
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(routed)
        x = ops.norm_add(h, x, self.post_feedforward_layernorm.weight, eps, None if self.ple else self.layer_scalar)
        if not self.ple:
            return x
        g = ops.act_mul(self.per_layer_input_gate(x), ple, "gelu_tanh")
        x = x + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return x * self.layer_scalar


class VocabParallelTable(nn.Module):
    """A vocab-parallel embedding table under its own checkpoint name (the per-layer
    embeddings [vocab_per_layer, layers * ple_dim]): rank r holds rows r*ceil(V/size) ...,
    zero-padded past V."""

    def __init__(self, vocab: int, dim: int, tp: TP):
        super().__init__()
        self.tp, self.vocab = tp, vocab
        self.weight = nn.Parameter(torch.empty(-(-vocab // tp.size), dim), requires_grad=False)

    def checkpoint_specs(self, prefix: str) -> list[WeightSpec]:
        name = prefix + ".weight"
        return [WeightSpec(self.weight, {name: (self.vocab, self.weight.shape[1])},
                           lambda t: self.tp.shard_padded(t[name], 0), lambda w: {name: w})]

    @checked
    def forward(self, token_ids: Int[Tensor, "num_tokens"]) -> Float[Tensor, "num_tokens _"]:
        # Ids past the per-layer vocabulary (a larger main vocabulary) read nothing (zeros).
        return vocab_parallel_embedding(token_ids, self.weight, self.tp)


class Gemma4ForCausalLM(FamilyModel):
    def __init__(self, cfg: Gemma4Config, ops: Ops, tp: TP | None = None):
        super().__init__()
        tp = tp or TP.single()
        check_tensor_parallel(cfg, tp.size)
        self.cfg, self.tp, self.ops = cfg, tp, ops
        H, V, L = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
        Vp = -(-V // tp.size)
        self.embed_tokens = nn.Parameter(torch.empty(Vp, H), requires_grad=False)
        _, self.layer_kv = kv_groups(cfg, tp.size)     # layer -> (KV group, index in it)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i, self.layer_kv[i], tp, ops) for i in range(L)])
        self.norm = GemmaRMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Parameter(torch.empty(Vp, H), requires_grad=False)
        self.ple_dim = cfg.hidden_size_per_layer_input
        if self.ple_dim:
            self.embed_tokens_per_layer = VocabParallelTable(cfg.vocab_size_per_layer_input, L * self.ple_dim, tp)
            self.per_layer_model_projection = Linear(H, L * self.ple_dim, tp)   # replicated
            self.per_layer_projection_norm = GemmaRMSNorm(self.ple_dim, cfg.rms_norm_eps)
        self._rounded_scales(torch.float32)

    # ---- what the engine reads before building the model (config.json alone) ----------
    check_tensor_parallel = staticmethod(check_tensor_parallel)

    @staticmethod
    def cache_spec(cfg: Gemma4Config, *, num_spec: int, tp_size: int = 1) -> CacheSpec:
        """Paged KV groups by (KV heads, head_dim, window); no recurrent state."""
        return CacheSpec(kv=tuple(kv_groups(cfg, tp_size)[0]))

    # ---- what a reader of its KV cache reads (the assistant) ------------------------------
    def kv_sources(self) -> dict[str, tuple[str, int]]:
        """Per layer type: (KV group, index in it) of the last layer of that type that
        computes its own KV (types without one are absent)."""
        sources = {kind: kv_source_of_type(self.cfg, kind) for kind in sorted(set(self.cfg.layer_types))}
        return {kind: self.layer_kv[src] for kind, src in sources.items() if src is not None}

    # ---- checkpoint names --------------------------------------------------------------
    def checkpoint_name(self, param_name: str) -> str:
        if param_name.startswith("lm_head"):
            return param_name
        return ("model.language_model." if self.cfg.multimodal else "model.") + param_name

    def ignored_checkpoint_prefixes(self) -> tuple[str, ...]:
        """The multimodal checkpoint's vision and audio towers: this text-only decoder skips them."""
        return TOWERS if self.cfg.multimodal else ()

    def row_major(self, name: str) -> bool:
        """Both embedding tables (the main one and the per-layer one), gathered by rows."""
        return name == "embed_tokens" or name.startswith("embed_tokens_per_layer")

    def set_weight_layout(self, device: torch.device) -> None:
        """FamilyModel's layout, after fixing the embedding scales for the loaded dtype."""
        self._rounded_scales(self.embed_tokens.dtype)
        super().set_weight_layout(device)

    @staticmethod
    def dummy_value(name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """Random ("dummy") weights: Gemma's norms and scales multiply by their weight, so they
        start at 1 (the dummy default for norms, 0, would zero every layer)."""
        leaf = name.rsplit(".", 1)[-1]
        if ("norm" in name and leaf == "weight") or leaf in ("layer_scalar", "scale", "per_expert_scale"):
            return torch.ones(shape)
        return None

    # ---- forward -------------------------------------------------------------------------
    def _rounded_scales(self, dtype: torch.dtype) -> None:
        # transformers multiplies by an fp32 scalar cast to the weight dtype (sqrt(3072) is
        # 55.5 in bf16): the same rounding here, as Python floats fixed once the dtype is
        # known (a traced graph cannot read a tensor's value).
        def rounded(scale):
            return torch.tensor(scale, dtype=torch.float32, device="cpu").to(dtype).item()
        self.embed_scale = rounded(self.cfg.hidden_size ** 0.5)
        self.ple_scale = rounded(self.ple_dim ** 0.5)

    @checked
    def embed(self, token_ids: Int[Tensor, "num_tokens"]) -> Float[Tensor, "num_tokens hidden"]:
        return vocab_parallel_embedding(token_ids, self.embed_tokens, self.tp) * self.embed_scale

    @checked
    def per_layer_inputs(self, token_ids: Int[Tensor, "num_tokens"], x0: Float[Tensor, "num_tokens hidden"]
                         ) -> Float[Tensor, "num_tokens layers ple_dim"]:
        """(RMSNorm(x0 W_pm^T * H^-0.5) + E_ple[ids] * sqrt(Dp)) * 2^-0.5, per layer."""
        T, L, Dp = token_ids.shape[0], self.cfg.num_hidden_layers, self.ple_dim
        tok = (self.embed_tokens_per_layer(token_ids) * self.ple_scale).view(T, L, Dp)
        proj = self.per_layer_projection_norm((self.per_layer_model_projection(x0) * self.cfg.hidden_size ** -0.5)
                                              .view(T, L, Dp))
        return (proj + tok) * 2.0 ** -0.5

    @checked
    def forward(self, token_ids: Int[Tensor, "num_tokens"], positions: Int[Tensor, "num_tokens"],
                meta: Metadata, cache: CacheTensors) -> Float[Tensor, "num_tokens hidden"]:
        """Final (post-norm) hidden states of every token; writes KV."""
        x = self.embed(token_ids)
        ple = self.per_layer_inputs(token_ids, x) if self.ple_dim else None
        # What every layer of a kind would compute alike, once per step: the RoPE angles per
        # (layer type, head_dim); in a uniform step the KV gather per pool (torch backend).
        angles, gathers = {}, {}
        gather = self.ops.verify_gather if isinstance(meta, UniformMetadata) and meta.kv_slots is None else None
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            kind, pool = (self.cfg.layer_types[i], self.cfg.head_dims[i]), cache.pool_index[attn.kv_group]
            if kind not in angles:
                angles[kind] = attn.rope.cos_sin(positions)
            if gather is not None and pool not in gathers:
                gathers[pool] = gather(meta.block_tables[pool], meta.seq_lens, meta.q_len, cache.block_size,
                                       meta.max_seq_len, attn.window)
            x = layer(x, None if ple is None else ple[:, i], positions, meta, cache, angles[kind], gathers.get(pool))
        return self.norm(x)

    @checked
    def compute_logits(self, hidden: Float[Tensor, "num_logits hidden"]) -> Float[Tensor, "num_logits vocab"]:
        w = self.embed_tokens if self.lm_head is None else self.lm_head
        logits = vocab_parallel_logits(hidden, w, self.tp, self.cfg.vocab_size)
        c = self.cfg.final_logit_softcapping
        return logits if c is None else torch.tanh(logits / c) * c
