"""Qwen3-Next: Gated DeltaNet + gated full attention + sparse MoE, with its MTP module.

Written against the kernels (mtpkit.kernels.ops.Ops) and the cache storage passed in
(mtpkit.step.cache.CacheTensors): no layer owns a cache. transformers 5.24 is the oracle for
its logits.
"""

import torch
from torch import nn

from mtpkit.kernels.ops import Ops
from mtpkit.step.metadata import PrefillMetadata, UniformMetadata
from mtpkit.step.cache import CacheTensors
from mtpkit.step.cache_spec import CacheSpec, KVGroup, StateGroup, StateTensor
from mtpkit.errors import ConfigError
from mtpkit.parallel import TP
from mtpkit.shapes import Float, Int, Tensor, checked
from mtpkit.layers.mlp import MLP
from mtpkit.layers.norm import GatedRMSNorm, RMSNorm, rms_norm_heads
from mtpkit.layers.linear import (Linear, MergedColumnParallelLinear, RowParallelLinear, vocab_parallel_embedding,
                                  vocab_parallel_logits)
from mtpkit.layers.rope import PartialRoPE
from mtpkit.layers.moe import SparseMoE, fused_expert_aliases
from mtpkit.models.family import FamilyModel
from mtpkit.models.qwen3_next.config import FULL, Qwen3NextConfig
from mtpkit.checkpoint.weights import WeightSpec, narrow, shard_range

Metadata = PrefillMetadata | UniformMetadata
KV_GROUP, MTP_KV_GROUP, STATE_GROUP = "attention", "mtp", "gdn"
MTP_PREFIX = "mtp."     # the MTP head's checkpoint names


def _attention_kv_group(cfg: Qwen3NextConfig, name: str, num_layers: int, tp_size: int) -> KVGroup:
    # KV heads split across ranks, replicated when there are fewer than ranks.
    return KVGroup(name, num_layers, max(1, cfg.num_key_value_heads // tp_size), cfg.head_dim)


def check_tensor_parallel(cfg: Qwen3NextConfig, size: int, with_mtp: bool = False) -> None:
    """ConfigError naming every dimension that `size` ranks cannot split. Needs config.json
    only, so the user hears all of them before any weight is read."""
    if size < 2:
        return
    layers = range(cfg.num_hidden_layers)
    moe = any(cfg.is_moe_layer(i) for i in layers) or (with_mtp and cfg.num_experts > 0)
    dense = any(not cfg.is_moe_layer(i) for i in layers) or (with_mtp and cfg.num_experts == 0)
    need = {}
    if cfg.full_layers or with_mtp:
        need["num_attention_heads"] = cfg.num_attention_heads
    if cfg.linear_layers:
        need["linear_num_key_heads"] = cfg.linear_num_key_heads      # whole key-head groups per rank
        need["linear_num_value_heads"] = cfg.linear_num_value_heads
    if moe:
        need["num_experts"] = cfg.num_experts                        # whole experts per rank
        need["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    if dense:
        need["intermediate_size"] = cfg.intermediate_size
    problems = [f"{name}={n} is not divisible by {size}" for name, n in need.items() if n % size]
    kv = cfg.num_key_value_heads
    if (cfg.full_layers or with_mtp) and kv % size and size % kv:
        # Fewer KV heads than ranks are replicated, which needs them to spread evenly.
        problems.append(f"num_key_value_heads={kv} neither divides nor is divisible by {size}")
    if problems:
        raise ConfigError(f"tensor_parallel_size={size} cannot split this model: " + "; ".join(problems)
                          + "; choose a tensor_parallel_size that divides all of them")


def _rows(*segments: tuple[int, int, int, int]) -> Tensor:
    """Row indices of strided segments, concatenated: (start, count, length, stride) gives
    rows start + i*stride + (0..length-1) for i in 0..count-1."""
    # On the CPU even while a model is built on the meta device: FP8 layouts read the values.
    return torch.cat([(start + torch.arange(count, device="cpu")[:, None] * stride
                       + torch.arange(length, device="cpu")).flatten()
                      for start, count, length, stride in segments])


class FullAttention(nn.Module):
    """Gated attention: q_proj gives [q | gate] per head, q/k zero-centred norms, partial RoPE,
    paged KV, output * sigmoid(gate) before o_proj.

    q_proj, k_proj and v_proj are one merged weight whose rows are laid out
    [q of every head | k | gate of every head | v], so q and k are adjacent: they are
    rotated together, and every piece is a view of the one matmul's output."""

    def __init__(self, cfg: Qwen3NextConfig, kv_group: str, kv_index: int, tp: TP, ops: Ops):
        super().__init__()
        self.kv_group, self.kv_index, self.ops, self.hd = kv_group, kv_index, ops, cfg.head_dim
        hd = self.hd
        # Query heads split evenly (q_proj rows are [q | gate] per head, so whole heads);
        # KV heads split too, or replicated when there are fewer than ranks.
        self.heads = tp.split(cfg.num_attention_heads, what="num_attention_heads")
        parts = [("q_proj", cfg.num_attention_heads * hd * 2, 2 * hd, False),
                 ("k_proj", cfg.num_key_value_heads * hd, hd, True),
                 ("v_proj", cfg.num_key_value_heads * hd, hd, True)]
        kv_rows = shard_range(cfg.num_key_value_heads * hd, hd, tp, "k_proj", replicate=True)[1]
        self.kv_heads = kv_rows // hd
        Q, KV = self.heads * 2 * hd, kv_rows
        order = _rows((0, self.heads, hd, 2 * hd), (Q, 1, KV, 0), (hd, self.heads, hd, 2 * hd), (Q + KV, 1, KV, 0))
        self.qkv_proj = MergedColumnParallelLinear(cfg.hidden_size, parts, tp, order)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * hd, cfg.hidden_size, tp)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.rope = PartialRoPE(hd, cfg.rot_dim, cfg.rope_theta)
        self.scale = hd ** -0.5

    @checked
    def forward(self, x: Float[Tensor, "num_tokens hidden"], positions: Int[Tensor, "num_tokens"], meta: Metadata,
                cache: CacheTensors) -> Float[Tensor, "num_tokens hidden"]:
        q, gate = self._project(x, positions, meta.slot_mappings, cache)
        return self._attend(q, gate, meta, cache)

    @checked
    def forward_rows(self, x: Float[Tensor, "num_tokens hidden"], positions: Int[Tensor, "num_tokens"],
                     slot_mappings: Int[Tensor, "kv_pools num_tokens"], cache: CacheTensors,
                     rows: Int[Tensor, "num_reqs_padded"],
                     row_meta: UniformMetadata) -> Float[Tensor, "num_reqs_padded hidden"]:
        """Every token's K/V written (at its slot), the output computed only for the tokens
        `rows` (one query each, described by `row_meta`): what the MTP layer needs from its
        first pass."""
        q, gate = self._project(x, positions, slot_mappings, cache)
        return self._attend(q[rows], gate[rows], row_meta, cache)

    def _project(self, x: Float[Tensor, "num_tokens hidden"], positions: Int[Tensor, "num_tokens"],
                 slot_mappings: Int[Tensor, "kv_pools num_tokens"], cache: CacheTensors
                 ) -> tuple[Float[Tensor, "num_tokens heads head_dim"], Float[Tensor, "num_tokens _"]]:
        """q (normed, rotated) and the output gate of every token; K/V written to the cache."""
        hq, hkv, hd = self.heads, self.kv_heads, self.hd
        h = self.qkv_proj(x)                                     # [T, (2 hq + 2 hkv) hd]
        qk_raw = h[:, :(hq + hkv) * hd].view(-1, hq + hkv, hd)
        gate = h[:, (hq + hkv) * hd:(2 * hq + hkv) * hd]
        v = h[:, (2 * hq + hkv) * hd:].view(-1, hkv, hd)
        qk = rms_norm_heads(qk_raw, [(self.q_norm, hq), (self.k_norm, hkv)])
        qk = self.rope(positions, qk)
        k_cache, v_cache = cache.kv[self.kv_group][self.kv_index]
        self.ops.write_kv(qk[:, hq:], v, k_cache, v_cache, slot_mappings[cache.pool_index[self.kv_group]])
        return qk[:, :hq], gate

    def _attend(self, q: Float[Tensor, "num_queries heads head_dim"], gate: Float[Tensor, "num_queries _"], meta: Metadata,
                cache: CacheTensors) -> Float[Tensor, "num_queries hidden"]:
        hq, hd = self.heads, self.hd
        k_cache, v_cache = cache.kv[self.kv_group][self.kv_index]
        pool = cache.pool_index[self.kv_group]
        if isinstance(meta, PrefillMetadata):
            o = self.ops.paged_attention_prefill(q, k_cache, v_cache, meta.query_start_loc,
                                                 meta.seq_lens, meta.block_tables[pool], self.scale)
        else:
            R, B = meta.num_reqs_padded, meta.q_len
            o = self.ops.paged_attention_verify(q.view(R, B, hq, hd), k_cache, v_cache,
                                                meta.seq_lens, meta.block_tables[pool], self.scale,
                                                max_seq_len=meta.max_seq_len,
                                                kv_slots=None if meta.kv_slots is None else meta.kv_slots[pool])
        return self.o_proj(self.ops.act_mul(gate, o.reshape(-1, hq * hd), "sigmoid"))   # o * sigmoid(gate)


class GatedDeltaNet(nn.Module):
    """Linear attention: projections, causal conv + SiLU, gated delta rule over fp32 state,
    gated RMSNorm with z, out_proj.

    The checkpoint's in_proj_qkvz and in_proj_ba are interleaved per key-head group
    ([HK, dk|dk|r*dv|r*dv] and [HK, r|r], as HF's fix_query_key_value_ordering reads them),
    so contiguous column shards are whole groups. Here they are one merged weight whose rows
    are re-laid out on load as [q | k | v | z | b | a] (each over all of this rank's heads):
    the conv input [q|k|v] and every other piece are then views of one matmul's output. The
    conv weight is [q|k|v]: the loader shards each segment on its own."""

    def __init__(self, cfg: Qwen3NextConfig, state_index: int, tp: TP, ops: Ops):
        super().__init__()
        self.state_index, self.ops, self.tp = state_index, ops, tp
        self.segments = (cfg.key_dim, cfg.key_dim, cfg.value_dim)   # conv channels [q | k | v], full
        self.hk = tp.split(cfg.linear_num_key_heads, what="linear_num_key_heads")
        self.hv = tp.split(cfg.linear_num_value_heads, what="linear_num_value_heads")
        self.dk, self.dv, self.W = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
        self.r = self.hv // self.hk
        H, hk, dk, rdv, r = cfg.hidden_size, self.hk, self.dk, self.r * self.dv, self.r
        G = 2 * dk + 2 * rdv                       # rows of one key-head group in in_proj_qkvz
        parts = [("in_proj_qkvz", 2 * cfg.key_dim + 2 * cfg.value_dim, G, False),
                 ("in_proj_ba", 2 * cfg.linear_num_value_heads, 2 * r, False)]
        Q = hk * G
        order = _rows((0, hk, dk, G), (dk, hk, dk, G), (2 * dk, hk, rdv, G), (2 * dk + rdv, hk, rdv, G),
                      (Q, hk, r, 2 * r), (Q + r, hk, r, 2 * r))
        self.in_proj = MergedColumnParallelLinear(H, parts, tp, order)
        self.conv_dim = 2 * hk * dk + self.hv * self.dv
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, self.W), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.hv), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.hv), requires_grad=False)
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps, ops)
        self.out_proj = RowParallelLinear(cfg.value_dim, H, tp)

    @checked
    def forward(self, x: Float[Tensor, "num_tokens hidden"], meta: Metadata, cache: CacheTensors) -> Float[Tensor, "num_tokens hidden"]:
        T, hk, hv, dk, dv, C = x.shape[0], self.hk, self.hv, self.dk, self.dv, self.conv_dim
        h = self.in_proj(x)                            # [T, q | k | v | z | b | a]
        mixed, z = h[:, :C], h[:, C:C + hv * dv].view(T, hv, dv)
        b, a = h[:, C + hv * dv:C + hv * dv + hv], h[:, C + hv * dv + hv:]
        state = cache.state[STATE_GROUP][self.state_index]
        conv_state, ssm_state = state["conv"], state["ssm"]
        prefill = isinstance(meta, PrefillMetadata)
        # State snapshots asked for by the step (metadata.StateSnapshots): written by the same
        # kernels, into this layer's rows of the snapshot store. None: the calls are unchanged.
        # A captured prefill (CPU graphs): rows of chunks padded to one length, a uniform step's layout.
        rows = None if prefill else meta.prefill
        snaps = meta.snapshots if prefill else None if rows is None else rows.snapshots
        snap = {} if snaps is None else cache.snapshots[STATE_GROUP][self.state_index]
        if prefill:
            # A prefill keeps the conv window in the request's first slot and leaves the
            # recurrent state in its last (as if the whole bundle was accepted).
            mixed = self.ops.causal_conv1d_prefill(mixed, self.conv_weight, conv_state, meta.query_start_loc,
                                                   meta.state_slots[:, 0], meta.has_initial_state,
                                                   snapshots=snaps, snapshot_state=snap.get("conv"))
        elif rows is not None:   # the same slots as a prefill's
            mixed = self.ops.causal_conv1d_prefill_rows(mixed, self.conv_weight, conv_state, meta.state_slots[:, 0],
                                                        rows.has_initial_state, rows.num_real,
                                                        snapshots=snaps, snapshot_state=snap.get("conv"))
        else:
            R, B = meta.num_reqs_padded, meta.q_len
            mixed = self.ops.causal_conv1d_verify(mixed.view(R, B, -1), self.conv_weight, conv_state,
                                                  meta.state_slots[:, 0], meta.prev_num_emitted).reshape(T, -1)
        q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
        q, k, v = q.view(T, hk, dk), k.view(T, hk, dk), v.view(T, hv, dv)
        if prefill:
            last = meta.state_slots[:, -1]
            o = self.ops.gated_delta_rule_prefill(q, k, v, a, b, self.A_log, self.dt_bias, ssm_state,
                                                  meta.query_start_loc, last, last, meta.has_initial_state,
                                                  snapshots=snaps, snapshot_state=snap.get("ssm"))
        elif rows is not None:
            o = self.ops.gated_delta_rule_prefill_rows(q, k, v, a, b, self.A_log, self.dt_bias, ssm_state,
                                                       meta.state_slots[:, -1], rows.has_initial_state, rows.num_real,
                                                       snapshots=snaps, snapshot_state=snap.get("ssm"))
        else:
            R, B = meta.num_reqs_padded, meta.q_len
            o = self.ops.gated_delta_rule_verify(
                q.view(R, B, hk, dk), k.view(R, B, hk, dk), v.view(R, B, hv, dv), a.view(R, B, hv),
                b.view(R, B, hv), self.A_log, self.dt_bias, ssm_state, meta.state_slots, meta.prev_num_emitted)
        o = self.norm(o.view(T, hv, dv), z).reshape(T, hv * dv)
        return self.out_proj(o)


    def checkpoint_specs(self, prefix: str) -> list[WeightSpec]:
        """The conv weight (checkpoint [conv_dim, 1, W]; channels [q | k | v], each segment
        sharded on its own), A_log and dt_bias (value heads, sharded). The projections and
        the norm describe themselves."""
        tp, conv_name = self.tp, prefix + ".conv1d.weight"

        def conv(t):
            parts, start = [], 0
            for seg in self.segments:
                part = seg // tp.size
                parts.append(narrow(t[conv_name], 0, start + tp.rank * part, part))
                start += seg
            return torch.cat(parts, dim=0).squeeze(1)

        specs = [WeightSpec(self.conv_weight, {conv_name: (sum(self.segments), 1, self.W)}, conv,
                            lambda w: {conv_name: w.unsqueeze(1)})]
        for leaf in ("A_log", "dt_bias"):
            name = f"{prefix}.{leaf}"
            specs.append(WeightSpec(getattr(self, leaf), {name: (self.hv * tp.size,)},
                                    lambda t, name=name: tp.shard(t[name], 0), lambda w, name=name: {name: w}))
        return specs


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3NextConfig, kind: str, moe: bool, cache_group: str, cache_index: int, tp: TP,
                 ops: Ops):
        super().__init__()
        self.kind = kind
        if kind == FULL:
            self.self_attn = FullAttention(cfg, cache_group, cache_index, tp, ops)
        else:
            self.linear_attn = GatedDeltaNet(cfg, cache_index, tp, ops)
        if moe:
            self.mlp = SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                                 cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size,
                                 cfg.norm_topk_prob, tp, ops)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, tp, ops)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    @checked
    def forward(self, x: Float[Tensor, "num_tokens hidden"], positions: Int[Tensor, "num_tokens"], meta: Metadata,
                cache: CacheTensors, residual: Float[Tensor, "num_tokens hidden"] | None = None
                ) -> tuple[Float[Tensor, "num_tokens hidden"], Float[Tensor, "num_tokens hidden"]]:
        """(h, residual): the layer's output hidden state is residual + h, an add left to the
        next norm, which does it in the same fused op (so does this layer's input norm with
        the previous layer's pair; `residual` None: x is the hidden state)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        if self.kind == FULL:
            h = self.self_attn(h, positions, meta, cache)
        else:
            h = self.linear_attn(h, meta, cache)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual

    @checked
    def forward_rows(self, x: Float[Tensor, "num_tokens hidden"], positions: Int[Tensor, "num_tokens"],
                     slot_mappings: Int[Tensor, "kv_pools num_tokens"], cache: CacheTensors,
                     rows: Int[Tensor, "num_reqs_padded"], row_meta: UniformMetadata
                     ) -> tuple[Float[Tensor, "num_reqs_padded hidden"], Float[Tensor, "num_reqs_padded hidden"]]:
        """A full-attention layer's (h, residual) at the tokens `rows` only (every token's K/V written)."""
        h = self.self_attn.forward_rows(self.input_layernorm(x), positions, slot_mappings, cache, rows, row_meta)
        h, residual = self.post_attention_layernorm(h, x[rows])
        return self.mlp(h), residual


class MTPModule(nn.Module):
    """The `mtp.*` module: x = fc([norm_e(embed(token_{p+1})), norm_h(h_p)]) -> one full-attention
    MoE decoder layer (own paged KV, same positions as the target) -> mtp.norm. Its output is
    both the hidden state for the next draft pass and the input of the shared lm_head."""

    def __init__(self, cfg: Qwen3NextConfig, tp: TP, ops: Ops):
        super().__init__()
        H = cfg.hidden_size
        self.pre_fc_norm_embedding = RMSNorm(H, cfg.rms_norm_eps, ops)
        self.pre_fc_norm_hidden = RMSNorm(H, cfg.rms_norm_eps, ops)
        self.fc = Linear(2 * H, H, tp)  # replicated (small); its decoder layer is sharded as the target's
        self.layers = nn.ModuleList([
            DecoderLayer(cfg, FULL, cfg.num_experts > 0, MTP_KV_GROUP, i, tp, ops)
            for i in range(cfg.num_nextn_predict_layers)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps, ops)

    @checked
    def forward(self, embeds: Float[Tensor, "num_tokens hidden"], hidden: Float[Tensor, "num_tokens hidden"],
                positions: Int[Tensor, "num_tokens"], meta: Metadata, cache: CacheTensors, step: int
                ) -> Float[Tensor, "num_tokens hidden"]:
        # num_spec may exceed the layer count: the layers are reused in turn.
        layer = self.layers[step % len(self.layers)]
        return self.norm(*layer(self._input(embeds, hidden), positions, meta, cache))[0].to(hidden.dtype)

    @checked
    def forward_rows(self, embeds: Float[Tensor, "num_tokens hidden"], hidden: Float[Tensor, "num_tokens hidden"],
                     positions: Int[Tensor, "num_tokens"], slot_mappings: Int[Tensor, "kv_pools num_tokens"],
                     cache: CacheTensors, rows: Int[Tensor, "num_reqs_padded"], row_meta: UniformMetadata
                     ) -> Float[Tensor, "num_reqs_padded hidden"]:
        """The first pass (layer 0): every token's K/V written at its slot, the output only at
        the tokens `rows`."""
        return self.norm(*self.layers[0].forward_rows(self._input(embeds, hidden), positions, slot_mappings, cache,
                                                      rows, row_meta))[0].to(hidden.dtype)

    def _input(self, embeds: Float[Tensor, "num_tokens hidden"], hidden: Float[Tensor, "num_tokens hidden"]
               ) -> Float[Tensor, "num_tokens hidden"]:
        """In this module's dtype (EngineArgs.draft_dtype may differ from the target's, whose
        embedding and hidden states come in; the output goes back in the hidden states' dtype)."""
        dt = self.norm.weight.dtype
        return self.fc(torch.cat([self.pre_fc_norm_embedding(embeds.to(dt)), self.pre_fc_norm_hidden(hidden.to(dt))],
                                 -1))


class Qwen3NextForCausalLM(FamilyModel):
    def __init__(self, cfg: Qwen3NextConfig, ops: Ops, tp: TP | None = None, with_mtp: bool = False):
        super().__init__()
        tp = tp or TP.single()
        check_tensor_parallel(cfg, tp.size, with_mtp)
        self.cfg, self.tp, self.ops = cfg, tp, ops
        H, V = cfg.hidden_size, cfg.vocab_size
        # Embedding and lm_head are vocab-parallel: ceil(V / size) rows per rank (zero-padded).
        Vp = -(-V // tp.size)
        self.embed_tokens = nn.Parameter(torch.empty(Vp, H), requires_grad=False)
        layers, n_full, n_lin = [], 0, 0
        for i, kind in enumerate(cfg.layer_types):
            idx = n_full if kind == FULL else n_lin
            n_full, n_lin = n_full + (kind == FULL), n_lin + (kind != FULL)
            group = KV_GROUP if kind == FULL else STATE_GROUP
            layers.append(DecoderLayer(cfg, kind, cfg.is_moe_layer(i), group, idx, tp, ops))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(H, cfg.rms_norm_eps, ops)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Parameter(torch.empty(Vp, H), requires_grad=False)
        self.mtp = MTPModule(cfg, tp, ops) if with_mtp else None

    # ---- what the engine reads before building the model (config.json alone) ----------
    check_tensor_parallel = staticmethod(check_tensor_parallel)

    @staticmethod
    def cache_spec(cfg: Qwen3NextConfig, *, num_spec: int, tp_size: int = 1) -> CacheSpec:
        """Paged KV for the full-attention layers; for the GDN layers a conv window of
        W - 1 + num_spec columns (a verify step may restart at any accepted count) and the
        fp32 recurrent state."""
        return CacheSpec(
            kv=(_attention_kv_group(cfg, KV_GROUP, len(cfg.full_layers), tp_size),),
            state=(StateGroup(STATE_GROUP, len(cfg.linear_layers), {
                "conv": StateTensor((cfg.conv_dim // tp_size, cfg.linear_conv_kernel_dim - 1 + num_spec)),
                "ssm": StateTensor((cfg.linear_num_value_heads // tp_size, cfg.linear_key_head_dim,
                                    cfg.linear_value_head_dim), fp32=True)}),))

    @staticmethod
    def mtp_cache_spec(cfg: Qwen3NextConfig, tp_size: int = 1) -> CacheSpec:
        """The MTP layers' own paged KV (what the MTP drafter adds to the target's)."""
        return CacheSpec(kv=(_attention_kv_group(cfg, MTP_KV_GROUP, cfg.num_nextn_predict_layers, tp_size),))

    # ---- checkpoint names --------------------------------------------------------------
    @staticmethod
    def checkpoint_name(param_name: str) -> str:
        return param_name if param_name.startswith((MTP_PREFIX, "lm_head")) else "model." + param_name

    def ignored_checkpoint_prefixes(self) -> tuple[str, ...]:
        """Checkpoint tensors this model leaves unread: the MTP head when it is not built."""
        return (MTP_PREFIX,) if self.mtp is None else ()

    @staticmethod
    def holds_mtp_head(checkpoint_names) -> bool:
        """Whether a checkpoint with these tensor names ships the MTP head (headers alone)."""
        return any(n.startswith(MTP_PREFIX) for n in checkpoint_names)

    def checkpoint_aliases(self, shapes: dict) -> dict:
        return fused_expert_aliases(shapes, self.cfg.num_experts, self.cfg.moe_intermediate_size)

    def row_major(self, name: str) -> bool:
        """The embedding (gathered by rows) and the GDN conv weights (per-channel taps, no
        matmul operand) stay row-major (set_weight_layout)."""
        return name == "embed_tokens" or name.endswith("conv_weight")

    @checked
    def embed(self, token_ids: Int[Tensor, "num_tokens"]) -> Float[Tensor, "num_tokens hidden"]:
        return vocab_parallel_embedding(token_ids, self.embed_tokens, self.tp)

    @checked
    def forward(self, token_ids: Int[Tensor, "num_tokens"], positions: Int[Tensor, "num_tokens"],
                meta: Metadata, cache: CacheTensors) -> Float[Tensor, "num_tokens hidden"]:
        """Final (post-norm) hidden states of every token; writes KV and GDN state."""
        x, residual = self.embed(token_ids), None
        for layer in self.layers:
            x, residual = layer(x, positions, meta, cache, residual)
        return self.norm(x, residual)[0]

    @checked
    def mtp_forward(self, token_ids: Int[Tensor, "num_tokens"], positions: Int[Tensor, "num_tokens"],
                    hidden: Float[Tensor, "num_tokens hidden"], meta: Metadata, cache: CacheTensors,
                    step: int = 0) -> Float[Tensor, "num_tokens hidden"]:
        """MTP pass: token_ids[i] is the token AFTER position positions[i]; hidden[i] the
        target's (or previous pass's) final hidden state at positions[i]."""
        return self.mtp(self.embed(token_ids), hidden, positions, meta, cache, step)

    @checked
    def mtp_forward_rows(self, token_ids: Int[Tensor, "num_tokens"], positions: Int[Tensor, "num_tokens"],
                         hidden: Float[Tensor, "num_tokens hidden"], slot_mappings: Int[Tensor, "kv_pools num_tokens"],
                         cache: CacheTensors, rows: Int[Tensor, "num_reqs_padded"], row_meta: UniformMetadata
                         ) -> Float[Tensor, "num_reqs_padded hidden"]:
        """The first MTP pass of a step: K/V of every position into the MTP layer's cache, the
        output only at `rows` (each request's last accepted position; `row_meta` their
        one-query metadata). Equal to mtp_forward(...)[rows], without computing the rest."""
        return self.mtp.forward_rows(self.embed(token_ids), hidden, positions, slot_mappings, cache, rows, row_meta)

    @checked
    def compute_logits(self, hidden: Float[Tensor, "num_logits hidden"]) -> Float[Tensor, "num_logits vocab"]:
        w = self.embed_tokens if self.lm_head is None else self.lm_head
        return vocab_parallel_logits(hidden, w, self.tp, self.cfg.vocab_size)
