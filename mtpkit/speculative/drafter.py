"""What a drafter declares before any weight is read (`DraftSetup`), and the helpers of its
one-token passes (`proposal_kv_slots`, `draft_pass_metadata`; on the torch backend the passes
run against a dense `scratch_cache` instead: `uses_scratch`) and their argmax under the
grammar masks of constrained rows (`pass_mask`, `draft_argmax`: every drafter's passes go
through them). The run-time interface (`DraftInputs`, `Drafter`) is step data:
mtpkit/step/draft.py.
"""

import dataclasses
from typing import Callable

import torch

from mtpkit.kernels.paged import context_slots, gather_slots, window_start
from mtpkit.sampling.bitmask import DraftMask
from mtpkit.shapes import Float, Int, Tensor, checked
from mtpkit.step.cache import CacheTensors
from mtpkit.step.cache_spec import CacheSpec
from mtpkit.step.metadata import UniformMetadata, uniform_metadata
from mtpkit.step.draft import DraftInputs, Drafter


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
    # Its KV at position p is computed from the token at p + 1 (the MTP head): a prefix cache
    # keys each block with the token after it too.
    kv_reads_next_token: bool = False
    # Checks of the checkpoints' headers (names, no data), run after the config checks.
    check_checkpoint: Callable[[], None] = lambda: None
    # Its passes may run in a dtype of their own (EngineArgs.draft_dtype): its weights are its own
    # modules' (Drafter.own_modules) and its inputs and outputs are cast at their boundary.
    own_dtype: bool = False


# A proposal's context length is a multiple of this: a compiled pass's attention multiplies q by
# K^T, which inductor's GEMM template packs in blocks of 16 columns; a ragged last block (135 keys
# at context 128 and num_spec 7) made it pack K^T one masked scalar at a time
# (benchmarks/proposal_context.py, docs/performance.md).
CTX_MULTIPLE = 16


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
    what lies past its own position: `draft_pass_metadata`). The context is rounded up to a
    multiple of CTX_MULTIPLE (the extra positions lie past every query: masked)."""
    ctx = min(-(-(max_seq_len + num_passes) // CTX_MULTIPLE) * CTX_MULTIPLE, block_tables.shape[2] * block_size)
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
    return _one_token_metadata(positions, block_tables, own[:, :, 0], clamped_slots(kv_slots, positions, own))


def _one_token_metadata(positions: Int[Tensor, "num_reqs_padded"],
                        block_tables: Int[Tensor, "kv_pools num_reqs_padded max_blocks"],
                        slot_mappings: Int[Tensor, "kv_pools num_reqs_padded"],
                        kv_slots: Int[Tensor, "kv_pools num_reqs_padded ctx_len"]) -> UniformMetadata:
    R = positions.shape[0]
    return uniform_metadata(
        seq_lens=positions + 1,
        block_tables=block_tables,
        slot_mappings=slot_mappings,
        state_slots=torch.zeros(R, 1, dtype=torch.int64, device=positions.device),
        prev_num_emitted=torch.ones(R, dtype=torch.int64, device=positions.device),
        q_len=1,
        max_seq_len=kv_slots.shape[2],
        kv_slots=kv_slots,
    )


def clamped_slots(kv_slots: Int[Tensor, "kv_pools num_reqs_padded ctx_len"], positions: Int[Tensor, "num_reqs_padded"],
                  own: Int[Tensor, "kv_pools num_reqs_padded 1"] | None = None
                  ) -> Int[Tensor, "kv_pools num_reqs_padded ctx_len"]:
    """kv_slots with every position past `positions` reading that position's slot (`own`)."""
    P, R, ctx = kv_slots.shape
    if own is None:
        own = kv_slots.gather(2, positions[None, :, None].expand(P, R, 1))
    past = torch.arange(ctx, device=positions.device)[None, None, :] > positions[None, :, None]
    return torch.where(past, own, kv_slots)


def uses_scratch(ops) -> bool:
    """Whether a proposal's one-token passes run against a `scratch_cache`: on a backend whose
    attention gathers each row's K/V densely through kv_slots (torch, `Ops.verify_gather`), where
    gathering once per proposal costs less than once per pass, and a compiled graph then writes each
    paged cache once (AOTInductor writes a graph input in place only when the graph writes it
    once, and copies the whole cache otherwise: benchmarks/aot_cache_writes.py). A Triton kernel
    reads the pages, and CUDA graphs write in place."""
    return ops.verify_gather is not None


@checked
def scratch_cache(cache: CacheTensors, kv_slots: Int[Tensor, "kv_pools num_reqs_padded ctx_len"],
                  groups: tuple[str, ...]) -> CacheTensors:
    """The caches of a proposal's one-token passes (the KV `groups` they run): each layer's K/V of every row's context
    positions 0..ctx_len-1, gathered once through `kv_slots` (after the step's own K/V are
    written; later positions clamped to a written one: `clamped_slots`) into one dense "block"
    per row (a pool of num_reqs_padded blocks of ctx_len slots; `scratch_pass_metadata`
    addresses it). The passes write their K/V there and never into the paged cache: those
    positions lie past every row's last accepted one, and the next step rewrites them (its
    bundle starts right after it) before anything reads them."""
    kv = {g: [gather_slots(k, v, kv_slots[cache.pool_index[g]]) for k, v in cache.kv[g]] for g in groups}
    return dataclasses.replace(cache, kv=kv, block_size=kv_slots.shape[2], state={}, snapshots={})


@checked
def scratch_slots(kv_slots: Int[Tensor, "kv_pools num_reqs_padded ctx_len"]) -> Int[Tensor, "kv_pools num_reqs_padded ctx_len"]:
    """The slot of every context position in a `scratch_cache` (row r's position p: r * ctx_len + p),
    for every pool alike. Every slot holds a finite value (a gathered or a clamped position's), so
    no pass needs them clamped further."""
    P, R, ctx = kv_slots.shape
    rows = torch.arange(R, device=kv_slots.device)[:, None] * ctx
    return (rows + torch.arange(ctx, device=kv_slots.device)[None, :])[None].expand(P, R, ctx)


@checked
def scratch_pass_metadata(slots: Int[Tensor, "kv_pools num_reqs_padded ctx_len"],
                          positions: Int[Tensor, "num_reqs_padded"]) -> UniformMetadata:
    """`draft_pass_metadata` in a `scratch_cache` (`slots`: its `scratch_slots`): one token per row
    at `positions`, its K/V written at row r's slot r * ctx_len + position, one block per row."""
    P, R, ctx = slots.shape
    rows = torch.arange(R, device=positions.device)
    return _one_token_metadata(positions, rows[None, :, None].expand(P, R, 1),
                               (rows * ctx + positions)[None].expand(P, R), slots)


def pass_mask(inp: DraftInputs, j: int,
              previous: Int[Tensor, "draft_rows"] | None) -> DraftMask | None:  # noqa: F821 - a jaxtyping dimension, not a name
    """Pass j's grammar mask (the state after the emitted tokens and drafts 0..j-1; `previous`:
    draft j - 1, None at pass 0), or None when no row is constrained (always when captured)."""
    return None if inp.draft_masks is None else inp.draft_masks(j, previous)


@checked
def draft_argmax(logits: Float[Tensor, "draft_rows vocab"], inp: DraftInputs, j: int,
                 previous: Int[Tensor, "draft_rows"] | None) -> Int[Tensor, "draft_rows"]:  # noqa: F821 - a jaxtyping dimension, not a name
    """Draft j of every row: the argmax of pass j's logits, masked first (in place) on the
    constrained rows, so that a constrained row drafts a token its grammar allows."""
    mask = pass_mask(inp, j, previous)
    if mask is not None:
        mask.apply_(logits)
    return logits.argmax(-1)
