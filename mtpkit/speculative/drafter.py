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
- `kv_read_back`: positions below the target's own sliding window that it reads in the
  target's sliding KV groups (blocks holding them must not be recycled yet);
- what the target model must build for it (the MTP head lives in the target checkpoint);
- its tensor-parallel constraints.
Drafts are greedy (argmax): the rejection sampler treats them as one-hot proposals.
"""

import dataclasses
from typing import Callable

import torch

from ..attn.metadata import PrefillMetadata, UniformMetadata
from ..attn.paged import context_slots
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
    slot_mapping: Int[Tensor, "num_tokens"]             # the KV slot of every position
    last_idx: Int[Tensor, "num_reqs_padded"]            # each row's last accepted token (flat index)
    block_table: Int[Tensor, "num_reqs_padded max_blocks"]
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
    """A drafter as its config describes it, before any weight is read.

    `kv_lookahead`: KV positions it writes past the last one the target step wrote.
    `kv_read_back`: for a round at position p (the newest committed token), how many
    positions before the target's own sliding window there (p - W + 1) the drafter still
    reads in the target's sliding KV groups, so the blocks holding them are kept: the Gemma 4
    assistant reads p-W-1..p-1, 2; a drafter with its own KV or none reads back 0.
    (Keyword-only, so the fields after it keep their places without defaults.)"""

    name: str
    num_spec: int
    kv_lookahead: int
    kv_read_back: int = dataclasses.field(default=0, kw_only=True)
    cache_spec: Callable[[int], CacheSpec]            # tp_size -> the groups it owns (prefixed)
    check_tensor_parallel: Callable[[int], None]
    build: Callable[..., Drafter]                     # (target model, load) -> Drafter
    target_kwargs: dict = dataclasses.field(default_factory=dict)   # what the target builds for it
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
    block_table: Int[Tensor, "num_reqs_padded max_blocks"],
    first: Int[Tensor, "num_reqs_padded"],
    num_passes: int,
    block_size: int,
    max_seq_len: int,
) -> Int[Tensor, "num_reqs_padded ctx_len"]:
    """The KV slot of every position the one-token passes of a proposal attend to, computed
    once for all of them: pass j (0-based) queries position first + j, so the context is
    max_seq_len + num_passes (capped by the block table), and positions past the last one a
    pass writes read that one's slot (storage the request owns: masked)."""
    ctx = min(max_seq_len + num_passes, block_table.shape[1] * block_size)
    return context_slots(block_table, first + (num_passes - 1), block_size, ctx)


@checked
def draft_pass_metadata(
    kv_slots: Int[Tensor, "num_reqs_padded ctx_len"],
    block_table: Int[Tensor, "num_reqs_padded max_blocks"],
    positions: Int[Tensor, "num_reqs_padded"],
) -> UniformMetadata:
    """Metadata of a one-token pass: one token per row at `positions` (q_len 1), K/V gathered
    through the proposal's `kv_slots` (built on the device). Padded rows sit in the null block."""
    R = positions.shape[0]
    return UniformMetadata(
        seq_lens=positions + 1,
        block_table=block_table,
        slot_mapping=kv_slots.gather(1, positions[:, None])[:, 0],
        state_slots=torch.zeros(R, 1, dtype=torch.int64, device=positions.device),
        prev_num_emitted=torch.ones(R, dtype=torch.int64, device=positions.device),
        num_reqs=R, num_reqs_padded=R, q_len=1,
        max_seq_len=kv_slots.shape[1],
        kv_slots=kv_slots,
    )
