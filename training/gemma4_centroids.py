"""The assistant's ordered embeddings (transformers' "masked embedding"): tokens grouped into
clusters of equal size (`token_ordering`), a centroid per cluster; the draft is the argmax over
the tokens of the top-k centroids only. Built from a trained plain assistant: clusters from its
head's rows, centroids trained to keep the plain head's own argmax (the rest frozen)."""

import dataclasses

import torch
import torch.nn.functional as F

from mtpkit.models.gemma4.model import Gemma4ForCausalLM
from mtpkit.models.gemma4.config import Gemma4Config
from mtpkit.shapes import Float, Int, Tensor
from training.gemma4_assistant import AssistantModel, rounds_input


def balanced_clusters(rows: Float[Tensor, "vocab hidden"], C: int, seed: int, iters: int = 25
                      ) -> Int[Tensor, "vocab"]:
    """token_ordering from a balanced k-means of the (normalised) output-head rows: C clusters
    of exactly V / C tokens each (each pass assigns (token, centroid) pairs best first, while
    the centroid has room), clusters laid out one after another."""
    V = rows.shape[0]
    if V % C:
        raise ValueError(f"vocab_size {V} is not divisible by num_centroids {C}")
    x = F.normalize(rows.float(), dim=-1)
    g = torch.Generator().manual_seed(seed)
    centers = x[torch.randperm(V, generator=g)[:C]]
    for _ in range(iters):
        order = (x @ centers.t()).flatten().argsort(descending=True)
        assign, room = torch.full((V,), -1), [V // C] * C
        for pair in order.tolist():
            tok, c = divmod(pair, C)
            if assign[tok] < 0 and room[c]:
                assign[tok], room[c] = c, room[c] - 1
        centers = F.normalize(torch.stack([x[assign == c].mean(0) for c in range(C)]), dim=-1)
    return torch.cat([torch.nonzero(assign == c).flatten() for c in range(C)])


def with_centroids(a: AssistantModel, target_cfg: Gemma4Config, C: int, top_k: int, seed: int) -> AssistantModel:
    """A copy of the plain assistant `a` with the centroid head: token_ordering from
    balanced_clusters of its head, centroids initialised to the clusters' mean rows."""
    c = dataclasses.replace(a.cfg, num_centroids=C, centroid_top_k=top_k)
    out = AssistantModel(c, target_cfg)
    missing = out.load_state_dict(a.state_dict(), strict=False).missing_keys
    assert missing == ["centroids.weight"], missing
    with torch.no_grad():
        out.token_ordering.copy_(balanced_clusters(a.embed_tokens, C, seed))
        out.centroids.weight.copy_(a.embed_tokens[out.token_ordering].view(C, -1, c.hidden_size).mean(1))
    return out


def centroid_loss(a: AssistantModel, target: Gemma4ForCausalLM, batch: Int[Tensor, "num_reqs seq_len"], T: int,
                  depth: int, queries: int | None, g: torch.Generator | None) -> tuple[Tensor, float]:
    """Cross-entropy of the centroid logits to the cluster of the tied head's own argmax, over
    the teacher-forced states d of draft steps 1..depth (the rest of the assistant frozen):
    the centroid path keeps the tied head's draft when that token's cluster is in the top k.
    Also returns that recall (the share of drafts the top-k clusters keep)."""
    from training.gemma4_target import run_target

    B, C = batch.shape[0], a.cfg.num_centroids
    cluster_of = torch.empty_like(a.token_ordering)
    cluster_of[a.token_ordering] = torch.arange(a.cfg.vocab_size) // (a.cfg.vocab_size // C)
    with torch.no_grad():
        hidden, _, cache = run_target(target, batch[:, :T])
        if queries is None or queries >= T - 1:
            p = torch.arange(1, T).expand(B, -1)
        else:
            p = torch.stack([torch.randperm(T - 1, generator=g)[:queries] + 1 for _ in range(B)]).sort(-1).values
        h, kv, masks = rounds_input(target, hidden, cache, B, T, p)
        ds = []
        for k in range(1, depth + 1):
            e = target.embed(batch.gather(1, p + k - 1).reshape(-1)).view(B, p.shape[1], -1)
            d, h = a.step(e, h, p, kv, masks)
            ds.append(d[p + k - 1 <= T - 1])
        d = torch.cat(ds)
        want = cluster_of[a.logits(d).argmax(-1)]
    logits = a.centroids(d)
    recall = (torch.topk(logits, a.cfg.centroid_top_k, -1).indices == want[:, None]).any(-1).float().mean().item()
    return F.cross_entropy(logits, want), recall
