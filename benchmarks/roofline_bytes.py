"""The byte model of benchmarks/roofline.py: the bytes one verify step and its drafting must
move, by part, and the routing recorder that says which experts (and centroid clusters) the
step touched.

Common terms: batch b, bundle B = num_spec + 1, context c tokens already cached per request
(the bundle sits at positions c .. c+B-1), T = b * B. Padded rows are left out: they are work
the step does, not bytes it must move. Every expert (every centroid cluster) the step's
routing chose is read once, however many tokens chose it. Activations are not counted.

Qwen3-Next (`qwen3_next_bytes`), drafting with its MTP head:
- target pass: non-expert weights once; per MoE layer the distinct experts chosen by the T real
  tokens (gate/up [2I, H] + down [H, I] each); T embedding rows; the lm_head once;
  per full-attention layer KV read for c + B positions and written for B, per request; per GDN
  layer the recurrent state read from one slot and written to B slots, the conv window read
  (W - 1 columns) and its slot written (W - 1 + num_spec columns), per request;
- MTP passes j = 1..num_spec: the MTP layer's non-expert weights, the experts its b rows chose,
  the lm_head; embedding rows and KV written: T in pass 1 (it writes every position of the
  step), b after; KV read c + j positions per request (the last accepted token at position c:
  no draft accepted, what random weights give).

Gemma 4 (`gemma4_bytes`), drafting with its assistant (num_spec 0: no drafter):
- target pass: non-expert weights once (a 26B-A4B layer's dense MLP, router and norms
  included; with attention_k_eq_v a full layer has no v_proj); per MoE layer the distinct
  experts the T tokens chose (gate/up [2I, H] + down [H, I] + its per_expert_scale entry);
  T embedding rows, and T rows of the per-layer embedding table [vocab, layers * Dp] when the
  config has one; the tied lm_head once (the final softcap moves no bytes);
- KV per layer, K and V of kv_heads x head_dim each (that layer's own sizes: sliding and full
  layers differ): a query at position p reads its window p-W+1 .. p, so a sliding layer's
  bundle reads the union, min(c + B, W - 1 + B) positions per request; a full layer reads
  c + B; each writes B per request. A KV-shared layer reads its source layer's KV like any
  layer of its type and writes none;
- assistant, num_spec steps over the b rows, all at the round position p = c + 1 (the bonus
  token after a verify step that accepted no draft: its KV is not written): per step its
  weights (layers, norm, pre/post projections, centroids), b rows of the TARGET's embedding
  (the newest token's), its output head: with the centroid head (use_ordered_embeddings) the
  distinct clusters its b rows chose (top-k of the centroid logits), each V / C rows of its
  tied table plus their V / C token_ordering entries (int64), else the whole table; and its
  reads of the target's KV: each layer of type t reads the last non-shared target layer of
  type t, full layers keys 0 .. p-1 (p positions), sliding layers p-W-1 .. p-1
  (min(p, W + 1) positions: transformers' drafter mask is one key wider than the target's
  window); it writes no KV.
A KV read is counted for every layer and every pass that reads it, each its own kernel: the
assistant's sliding layers all read the same target layer, once per draft step, and a
KV-shared layer rereads its source (a fused kernel or the L2 cache could read them once).
"""

import contextlib
import dataclasses
import sys
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mtpkit.models.gemma4.assistant_config import kv_source_of_type  # noqa: E402
from mtpkit.models.gemma4.config import SLIDING, Gemma4Config  # noqa: E402
from mtpkit.layers.moe import SparseMoE  # noqa: E402

CLUSTERS = "drafter.masked_embedding"   # routing key of the assistant's centroid choices
DRAFT_PREFIXES = ("mtp ", "drafter ")   # parts that belong to the drafting, not the verify pass


@dataclasses.dataclass(frozen=True)
class Step:
    batch: int
    num_spec: int
    context: int          # tokens cached per request before the step


# ---- routing ---------------------------------------------------------------------------------
@contextlib.contextmanager
def record_routing(model, num_reqs: int, num_reqs_padded: int, drafter=None):
    """Records, per MoE module name, one tensor of chosen expert ids per call (its real rows:
    a call over num_reqs_padded * k rows keeps the first num_reqs * k). Patches `route` on
    the instances, so every MoE path (sparse, dense, grouped) is seen. `drafter`: a separate
    drafter module (the Gemma 4 assistant): its MoEs under "drafter.<name>" and, with a
    centroid head, the clusters each call's real rows chose under CLUSTERS (the top-k of
    the centroid logits, as its argmax takes them)."""
    calls: dict[str, list[torch.Tensor]] = defaultdict(list)
    patched = []
    for prefix, root in (("", model), ("drafter.", drafter)):
        if root is None:
            continue
        for name, m in root.named_modules():
            if isinstance(m, SparseMoE):
                def route(logits, _orig=m.route, _name=prefix + name):
                    weights, experts = _orig(logits)
                    per_row = experts.shape[0] // num_reqs_padded
                    calls[_name].append(experts[:per_row * num_reqs].detach().cpu())
                    return weights, experts
                m.route = route
                patched.append((m, "route"))
    head = getattr(drafter, "masked_embedding", None)
    if head is not None:
        def centroids(d, _orig=head.centroids.forward, _k=head.top_k):
            logits = _orig(d)
            calls[CLUSTERS].append(logits[:num_reqs].topk(_k, dim=-1).indices.detach().cpu())
            return logits
        head.centroids.forward = centroids
        patched.append((head.centroids, "forward"))
    try:
        yield calls
    finally:
        for m, attr in patched:
            delattr(m, attr)


def _calls(routing: dict, name: str, passes: int) -> list[torch.Tensor]:
    calls = routing.get(name, [])
    if len(calls) < passes:
        raise ValueError(f"routing for {name}: {len(calls)} calls recorded, the step makes {passes}")
    return calls[:passes]


# ---- bytes -----------------------------------------------------------------------------------
def _moe_split(model) -> dict[str, tuple[int, int]]:
    """MoE module name -> (bytes of one expert, bytes of its non-expert weights). A Gemma 4
    expert also has its per_expert_scale entry, read for the experts chosen."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, SparseMoE):
            isz, H, I, S = m.w13.element_size(), m.hidden, m.inter, m.shared_range[1]
            scale = getattr(m, "per_expert_scale", None)
            out[name] = (3 * I * H * isz + (0 if scale is None else scale.element_size()),
                         (m.w_in.numel() + H * S) * isz)
    return out


def _nbytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def step_bytes(model, cfg, step: Step, routing: dict[str, list[torch.Tensor]], drafter=None) -> dict[str, int]:
    """Bytes one verify step and its drafting must move, by part (the byte model in this
    module's docstring). `routing`: per MoE module name, the expert ids of each call, in call
    order (the target layers once each; a drafter's layers once per pass). `drafter`: the
    Gemma 4 assistant module when it drafts (Qwen3-Next's MTP head is part of its model)."""
    if isinstance(cfg, Gemma4Config):
        return gemma4_bytes(model, cfg, step, routing, drafter)
    return qwen3_next_bytes(model, cfg, step, routing)


def qwen3_next_bytes(model, cfg, step: Step, routing: dict[str, list[torch.Tensor]]) -> dict[str, int]:
    b, k, c = step.batch, step.num_spec, step.context
    B, T = k + 1, step.batch * (k + 1)
    H = cfg.hidden_size
    isz = model.embed_tokens.element_size()
    moe = _moe_split(model)
    lm_head = (model.embed_tokens if model.lm_head is None else model.lm_head).numel() * isz
    out: dict[str, int] = defaultdict(int)

    skip = {"embed_tokens", "lm_head"}
    for name, p in model.named_parameters():
        owner = name.rsplit(".", 1)[0]
        if name in skip or owner in moe:
            continue
        part = "mtp weights" if name.startswith("mtp.") else "weights"
        out[part] += _nbytes(p) * (k if part == "mtp weights" else 1)
    for name, (per_expert, dense) in moe.items():
        mtp = name.startswith("mtp.")
        passes = k if mtp else 1
        calls = _calls(routing, name, passes)
        out["mtp weights" if mtp else "weights"] += dense * passes
        for experts in calls:
            out["mtp experts" if mtp else "experts"] += int(torch.unique(experts).numel()) * per_expert
    out["embedding"] += T * H * isz
    out["lm_head"] += lm_head

    kv_token = 2 * cfg.num_key_value_heads * cfg.head_dim * isz       # K and V of one position, one layer
    n_full, n_gdn = len(cfg.full_layers), len(cfg.linear_layers)
    out["kv read"] += n_full * b * (c + B) * kv_token
    out["kv written"] += n_full * T * kv_token
    state_isz = 8 if model.embed_tokens.dtype == torch.float64 else 4   # the recurrent state is fp32 (fp64 in fp64)
    ssm = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * state_isz
    W, conv_dim = cfg.linear_conv_kernel_dim, cfg.conv_dim
    out["gdn state read"] += n_gdn * b * ssm
    out["gdn state written"] += n_gdn * T * ssm
    out["conv state read"] += n_gdn * b * conv_dim * (W - 1) * isz
    out["conv state written"] += n_gdn * b * conv_dim * (W - 1 + k) * isz

    if k:
        out["mtp embedding"] += (T + (k - 1) * b) * H * isz
        out["mtp lm_head"] += k * lm_head
        out["mtp kv written"] += (T + (k - 1) * b) * kv_token
        out["mtp kv read"] += sum(b * (c + j) * kv_token for j in range(1, k + 1))
    return dict(out)


def gemma4_bytes(model, cfg: Gemma4Config, step: Step, routing: dict[str, list[torch.Tensor]],
                 assistant=None) -> dict[str, int]:
    b, k, c = step.batch, step.num_spec, step.context
    B, T = k + 1, step.batch * (k + 1)
    H, W = cfg.hidden_size, cfg.sliding_window
    isz = model.embed_tokens.element_size()
    moe = _moe_split(model)
    out: dict[str, int] = defaultdict(int)

    tables = {"embed_tokens", "lm_head", "embed_tokens_per_layer.weight"}
    for name, p in model.named_parameters():
        if name not in tables and name.rsplit(".", 1)[0] not in moe:
            out["weights"] += _nbytes(p)
    for name, (per_expert, dense) in moe.items():
        out["weights"] += dense
        (experts,) = _calls(routing, name, 1)
        out["experts"] += int(torch.unique(experts).numel()) * per_expert
    out["embedding"] += T * H * isz
    if cfg.hidden_size_per_layer_input:
        table = model.embed_tokens_per_layer.weight
        out["per-layer embedding"] += T * table.shape[1] * table.element_size()
    out["lm_head"] += _nbytes(model.embed_tokens if model.lm_head is None else model.lm_head)

    def kv_token(layer: int) -> int:   # K and V of one position of that layer
        return 2 * cfg.kv_heads[layer] * cfg.head_dims[layer] * isz

    for i in range(cfg.num_hidden_layers):
        src = cfg.kv_source(i)
        positions = min(c + B, W - 1 + B) if cfg.layer_types[i] == SLIDING else c + B
        out["kv read"] += b * positions * kv_token(src)
        if src == i:
            out["kv written"] += T * kv_token(i)

    if assistant is None or k == 0:
        return dict(out)
    a = assistant.cfg
    head = assistant.masked_embedding
    skip = {"embed_tokens", "masked_embedding.token_ordering"}
    out["drafter weights"] += k * sum(_nbytes(p) for name, p in assistant.named_parameters() if name not in skip)
    out["drafter embedding"] += k * b * H * isz                      # the target's rows of the newest tokens
    if head is None:
        out["drafter lm_head"] += k * _nbytes(assistant.embed_tokens)
    else:
        per_cluster = a.vocab_size // a.num_centroids
        row = assistant.embed_tokens.shape[1] * assistant.embed_tokens.element_size()
        per_cluster_bytes = per_cluster * (row + head.token_ordering.element_size())
        out["drafter lm_head"] += sum(int(torch.unique(cl).numel()) * per_cluster_bytes
                                      for cl in _calls(routing, CLUSTERS, k))
    p = c + 1
    for kind in a.text.layer_types:
        src = kv_source_of_type(cfg, kind)
        positions = min(p, W + 1) if kind == SLIDING else p
        out["drafter kv read"] += k * b * positions * kv_token(src)
    return dict(out)
