"""The drafter interface: what a drafter reads after a target step, what it returns, and what
it declares before any weight is read.

After every target step the engine hands the drafter a `DraftInputs` (the step's tokens,
positions, the target's final hidden states, the token after each position and each row's
last accepted index) and gets `[num_reqs_padded, num_spec]` greedy drafts back. After a
verify step this runs inside the same captured graph family as the verify step (CUDA graph;
CPU trace), so a drafter computes everything on the device from tensors: no host reads.

A drafter declares (`DraftSetup`, from config.json alone):
- the cache groups it owns (its own paged KV, allocated in the target's block pool under a
  name prefix), or none when it reads the target's;
- `kv_lookahead`: KV positions it writes past the last position the target step wrote (the
  scheduler reserves blocks for them);
- `kv_read_back`: positions before a sliding window's start (p - W + 1 for a query at p) it
  still reads (the scheduler keeps those blocks);
- what the target model must build for it (the MTP head lives in the target checkpoint);
- its tensor-parallel constraints.
Drafts are greedy (argmax): the rejection sampler treats them as one-hot proposals.
"""

import dataclasses
from typing import Callable

import torch

from ..attn.metadata import PrefillMetadata, UniformMetadata
from ..attn.paged import context_slots, window_start
from ..engine.cache import CacheTensors
from ..engine.cache_spec import CacheSpec
from ..shapes import Float, Int, Tensor, checked, shaped_dataclass


@shaped_dataclass(frozen=True)
class DraftInputs:
    """One target step, as a drafter reads it. Rows are the requests to draft for (a verify
    step: every row, padded ones included; a prefill: the prompts that finished)."""

    hidden: Float[Tensor, "num_tokens hidden"]          # the target's final (post-norm) hidden states
    token_ids: Int[Tensor, "num_tokens"]                # the tokens the step fed
    next_tokens: Int[Tensor, "num_tokens"]              # the token after each position
    positions: Int[Tensor, "num_tokens"]
    slot_mappings: Int[Tensor, "kv_pools num_tokens"]   # the KV slot of every position, in each pool
    last_idx: Int[Tensor, "num_reqs_padded"]            # each row's last accepted token (flat index)
    block_tables: Int[Tensor, "kv_pools num_reqs_padded max_blocks"]
    max_seq_len: int                                    # longest sequence of the step
    # The step's own metadata, for a drafter that runs a model over the step's tokens. None in
    # a traced prefill proposal (only drafters with `needs_step_metadata` False are traced there).
    meta: PrefillMetadata | UniformMetadata | None = None


class Drafter:
    """Base of every drafter. `propose` after a step that samples; `observe` after a prefill
    chunk that samples nothing (a drafter with its own KV fills it there)."""

    num_spec: int
    needs_step_metadata = False

    def propose(self, inp: DraftInputs, cache: CacheTensors) -> Int[Tensor, "num_reqs_padded num_spec"]:
        raise NotImplementedError

    def observe(self, inp: DraftInputs, cache: CacheTensors) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class DraftSetup:
    """A drafter as its config describes it, before any weight is read."""

    name: str
    num_spec: int
    kv_lookahead: int
    cache_spec: Callable[[int], CacheSpec]            # tp_size -> the groups it owns (prefixed)
    check_tensor_parallel: Callable[[int], None]
    build: Callable[..., Drafter]                     # (target model, load) -> Drafter
    target_kwargs: dict = dataclasses.field(default_factory=dict)   # what the target builds for it
    # Positions before a sliding window's start it reads (the target's KV, one key further back).
    kv_read_back: int = 0
    # Checks of the checkpoints' headers (names, no data), run after the config checks.
    check_checkpoint: Callable[[], None] = lambda: None


@checked
def verify_outcome(
    token_ids: Int[Tensor, "num_reqs_padded bundle"],
    tokens: Int[Tensor, "num_reqs_padded bundle"],
    num_emitted: Int[Tensor, "num_reqs_padded"],
) -> tuple[Int[Tensor, "num_tokens"], Int[Tensor, "num_reqs_padded"]]:
    """After a verify step that fed `token_ids` ([last token, d_1..d_k] per row) and emitted
    tokens[i, :num_emitted[i]]: the token after each bundle position (what was emitted at
    the accepted positions, the next draft d_{j+1} after them; 0 after the last) and the flat
    index of each row's last accepted position. (Inert padded rows emit one token 0 and keep
    pointing at null storage.)"""
    R, B = token_ids.shape
    after = torch.cat([token_ids[:, 1:], torch.zeros_like(token_ids[:, :1])], dim=1)    # d_{j+1}
    accepted = torch.arange(B, device=tokens.device)[None, :] < num_emitted[:, None]
    next_tokens = torch.where(accepted, tokens, after)
    last_idx = torch.arange(R, device=tokens.device) * B + num_emitted - 1
    return next_tokens.reshape(-1), last_idx


@checked
def proposal_kv_slots(
    block_tables: Int[Tensor, "kv_pools num_reqs_padded max_blocks"],
    first: Int[Tensor, "num_reqs_padded"],
    num_passes: int,
    block_size: int,
    max_seq_len: int,
    pool_windows: tuple[int | None, ...],
) -> Int[Tensor, "kv_pools num_reqs_padded ctx_len"]:
    """The KV slot of every position the one-token passes of a proposal attend to, in every
    pool, computed once for all of them: pass j (0-based) queries position first + j, so the
    context is max_seq_len + num_passes (capped by the block table). Positions past the last
    one the passes write read that one's slot, and in a sliding pool positions before the
    first pass's window its first key's (storage the request owns; each pass then clamps
    what lies past its own position: `draft_pass_metadata`)."""
    ctx = min(max_seq_len + num_passes, block_tables.shape[2] * block_size)
    return torch.stack([context_slots(table, first + (num_passes - 1), block_size, ctx, window_start(first, w))
                        for table, w in zip(block_tables, pool_windows)])


@checked
def draft_pass_metadata(
    kv_slots: Int[Tensor, "kv_pools num_reqs_padded ctx_len"],
    block_tables: Int[Tensor, "kv_pools num_reqs_padded max_blocks"],
    positions: Int[Tensor, "num_reqs_padded"],
) -> UniformMetadata:
    """Metadata of a one-token pass: one token per row at `positions` (q_len 1), K/V gathered
    through the proposal's `kv_slots` (built on the device), positions past the pass's own
    reading its own slot: the later passes' slots are not written yet and may hold anything
    (a block that held another request's NaN, say), which 0 * NaN would leak through the
    masked softmax. Padded rows sit in the null block."""
    P, R, ctx = kv_slots.shape
    own = kv_slots.gather(2, positions[None, :, None].expand(P, R, 1))                  # [P, R, 1]
    past = torch.arange(ctx, device=positions.device)[None, None, :] > positions[None, :, None]
    return UniformMetadata(
        seq_lens=positions + 1,
        block_tables=block_tables,
        slot_mappings=own[:, :, 0],
        state_slots=torch.zeros(R, 1, dtype=torch.int64, device=positions.device),
        prev_num_emitted=torch.ones(R, dtype=torch.int64, device=positions.device),
        num_reqs=R, num_reqs_padded=R, q_len=1,
        max_seq_len=ctx,
        kv_slots=torch.where(past, own, kv_slots),
    )
