"""Attention metadata: typed dataclasses built by pure functions from a scheduled step.

Two layouts, and only two:
- PREFILL: ragged chunks of prompts, packed token-major (`query_start_loc`), run eager (a
  captured prefill takes the uniform layout below).
- UNIFORM: every row feeds the same number of query tokens (`q_len`), request-major. A verify
  step has q_len = bundle tokens per row (num_spec + 1; 1 without speculation), a drafter's
  one-token pass has q_len = 1 (its own dimension, so a trace never reads "bundle=1"). A
  captured prefill (CPU graphs) is a uniform step too: its rows are prefill chunks padded at
  their ends to q_len tokens (`UniformMetadata.prefill`, PrefillRows: each row's real tokens and
  whether a previous chunk left state); padding tokens write their positions' KV slots (as a
  verify step's drafts do; the row's later tokens overwrite them) and leave the recurrent state
  as the chunk's last real token left it, and causal attention keeps them out
  of every real token's output.
  Rows are padded to `num_reqs_padded` (a captured graph size). Padded rows are real rows
  that point at null storage: token 0, positions 0..q-1, seq_len q, block-table row of the
  null block (0), state slots of the null slot (0), prev_num_emitted 1. They compute finite
  garbage into null storage and are never sampled.

KV blocks: a request has one block table per KV pool (engine/kv_pools.py: full attention, and
one pool per sliding window, whose tables hold only the blocks the window can still read), so
the tables and slot mappings are stacked over pools: `block_tables[pool]`, `slot_mappings[pool]`
(a layer finds its pool in `CacheTensors.pool_index`).

State snapshots: a prefill step may also write the recurrent state (GDN and conv) as it stands
after given tokens of its chunks into rows of the snapshot store (`StateSnapshots`, asked for
as (row, position within the chunk, snapshot id) triples; docs/design.md, "State snapshots").
None when no snapshot is asked for: nothing else changes, and uniform steps never carry any.

Builders run on the host (lists -> one tensor each) and move every tensor to the device once.
"""

import dataclasses
from collections.abc import Sequence

import torch

from mtpkit.shapes import Bool, Int, Tensor, checked, shaped_dataclass


@dataclasses.dataclass(frozen=True)
class PrefillChunk:
    """One request's share of a prefill step: tokens at positions start .. start+len-1."""

    token_ids: list[int]
    start: int                 # tokens of this request already in the caches
    block_ids: list[list[int]]  # per KV pool: logical block -> block id
    state_slots: list[int]     # the request's state slots (empty: the model keeps no state)


@dataclasses.dataclass(frozen=True)
class UniformRow:
    """One request's row of a uniform step."""

    token_ids: list[int]       # q tokens: [last sampled, drafts...] (verify) or [draft] (MTP)
    start: int                 # position of token_ids[0]
    block_ids: list[list[int]]  # per KV pool (empty lists: a padded row's null block)
    state_slots: list[int]     # the request's bundle state slots (verify); ignored by draft passes
    prev_num_emitted: int          # tokens accepted for this request in its previous step (>= 1)


@shaped_dataclass(frozen=True)
class StateSnapshots:
    """The snapshots a prefill step writes: snapshot ids[i] receives the recurrent state of
    request rows[i] as it stands after the step's token token_index[i] (an index into the
    step's packed tokens: query_start_loc[row] + the position within the chunk), in the
    layout a prefill ending there leaves in the request's slots (conv: the last
    conv_state_len inputs, ssm: the state after the token). Token indices are distinct."""

    rows: Int[Tensor, "num_snapshots"]
    token_index: Int[Tensor, "num_snapshots"]
    ids: Int[Tensor, "num_snapshots"]


@shaped_dataclass(frozen=True)
class PrefillMetadata:
    seq_lens: Int[Tensor, "num_reqs"]                  # cached prefix + this chunk
    query_start_loc: Int[Tensor, "num_reqs+1"]
    block_tables: Int[Tensor, "kv_pools num_reqs max_blocks"]
    slot_mappings: Int[Tensor, "kv_pools num_tokens"]  # KV slot of every token, in each pool
    state_slots: Int[Tensor, "num_reqs bundle"]        # each request's state slots
    has_initial_state: Bool[Tensor, "num_reqs"]        # a previous chunk left state behind
    logits_indices: Int[Tensor, "num_reqs"]            # the last token of every chunk
    num_reqs: int
    max_seq_len: int                                   # host copy, so attention needs no sync
    snapshots: StateSnapshots | None = None            # state snapshots to write (None: none)


@shaped_dataclass(frozen=True)
class PrefillRows:
    """The rows of a uniform step that are prefill chunks, each padded at its end to q_len tokens
    (a captured prefill, graphs/captured.py): tensors, so one graph serves any chunk length up to
    q_len."""

    num_real: Int[Tensor, "num_reqs_padded"]             # the chunk's tokens, then padding
    has_initial_state: Bool[Tensor, "num_reqs_padded"]   # a previous chunk left state behind
    snapshots: StateSnapshots | None = None              # token_index into the padded rows (None: none)


@shaped_dataclass(frozen=True)
class UniformMetadata:
    seq_lens: Int[Tensor, "num_reqs_padded"]           # context including this step's tokens
    block_tables: Int[Tensor, "kv_pools num_reqs_padded max_blocks"]
    slot_mappings: Int[Tensor, "kv_pools num_tokens"]
    state_slots: Int[Tensor, "num_reqs_padded row_slots"]  # verify, prefill rows: the request's bundle slots
    prev_num_emitted: Int[Tensor, "num_reqs_padded"]
    # Real rows (the rest are padding) where the builder knows them: a step built on the host
    # from its scheduled rows. None inside a captured body or a drafter's pass, which see only
    # the padded rows (a graph replays for any number of real rows up to its size).
    num_reqs: int | None
    num_reqs_padded: int                               # every row, padded ones included
    q_len: int                                         # query tokens per row
    max_seq_len: int
    # The KV-cache slot of every position 0..ctx_len-1 of each row in each pool, or None:
    # computed from the block tables. A drafter's proposal computes it once for all its passes
    # (speculative.drafter.proposal_kv_slots); the torch attention then gathers through it (the
    # Triton kernel walks the block table either way).
    kv_slots: Int[Tensor, "kv_pools num_reqs_padded ctx_len"] | None = None
    # A captured prefill's rows (see the module docstring); None: a verify step or a drafter's pass.
    prefill: PrefillRows | None = None

    @property
    def num_tokens(self) -> int:
        return self.num_reqs_padded * self.q_len


def uniform_metadata(
    seq_lens: Int[Tensor, "num_reqs_padded"], block_tables: Int[Tensor, "kv_pools num_reqs_padded max_blocks"],
    slot_mappings: Int[Tensor, "kv_pools num_tokens"], state_slots: Int[Tensor, "num_reqs_padded row_slots"],
    prev_num_emitted: Int[Tensor, "num_reqs_padded"], q_len: int, max_seq_len: int,
    num_reqs: int | None = None, kv_slots: Int[Tensor, "kv_pools num_reqs_padded ctx_len"] | None = None,
    prefill: PrefillRows | None = None,
) -> UniformMetadata:
    """The one place a UniformMetadata is made (`build_uniform` on the host, a captured body
    from its buffers, a drafter's one-token pass on the device). The padded row count is the
    tensors' own; `num_reqs` (real rows) only where the caller knows it."""
    return UniformMetadata(
        seq_lens=seq_lens, block_tables=block_tables, slot_mappings=slot_mappings, state_slots=state_slots,
        prev_num_emitted=prev_num_emitted, num_reqs=num_reqs, num_reqs_padded=seq_lens.shape[0], q_len=q_len,
        max_seq_len=max_seq_len, kv_slots=kv_slots, prefill=prefill)


def _block_tables(rows: list[list[list[int]]], max_blocks: int) -> Tensor:
    """[pools, rows, max_blocks] from each row's per-pool block ids."""
    pools = len(rows[0])
    table = torch.zeros(pools, len(rows), max_blocks, dtype=torch.int64)
    for i, per_pool in enumerate(rows):
        for p, ids in enumerate(per_pool):
            if ids:
                table[p, i, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
    return table


def _slots(positions: Int[Tensor, "num_tokens"], tables: Int[Tensor, "kv_pools num_reqs max_blocks"],
           row_of_token: Int[Tensor, "num_tokens"], block_size: int) -> Int[Tensor, "kv_pools num_tokens"]:
    blocks = tables[:, row_of_token, positions // block_size]
    return blocks * block_size + positions % block_size


def _snapshots(snapshots, lens: list[int], qsl: Int[Tensor, "num_reqs+1"], device: torch.device
               ) -> StateSnapshots | None:
    """StateSnapshots from (row, position within the chunk, snapshot id) triples (None: none)."""
    if not snapshots:
        return None
    for row, pos, sid in snapshots:
        if not (0 <= row < len(lens) and 0 <= pos < lens[row]):
            raise ValueError(f"snapshot ({row}, {pos}, {sid}): position {pos} is not in row {row}'s chunk")
    if len({(r, p) for r, p, _ in snapshots}) != len(snapshots) or len({s for *_, s in snapshots}) != len(snapshots):
        raise ValueError("a step writes each snapshot id once and each position at most once")
    rows = torch.tensor([r for r, _, _ in snapshots], dtype=torch.int64)
    pos = torch.tensor([p for _, p, _ in snapshots], dtype=torch.int64)
    return StateSnapshots(rows=rows.to(device), token_index=(qsl[rows] + pos).to(device),
                          ids=torch.tensor([s for *_, s in snapshots], dtype=torch.int64, device=device))


@checked
def build_prefill(
    chunks: list[PrefillChunk], block_size: int, max_blocks: int, device: torch.device,
    snapshots: Sequence[tuple[int, int, int]] = (),
) -> tuple[Int[Tensor, "num_tokens"], Int[Tensor, "num_tokens"], PrefillMetadata]:
    """token_ids, positions and metadata of a prefill step. `snapshots`: (row, position
    within the row's chunk, snapshot id) triples, the state after that token saved to that id."""
    lens = [len(c.token_ids) for c in chunks]
    for c in chunks:
        need = -(-(c.start + len(c.token_ids)) // block_size)
        assert all(len(ids) >= need for ids in c.block_ids), "scheduler must allocate blocks before building"
    token_ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.int64)
    positions = torch.cat([torch.arange(c.start, c.start + n) for c, n in zip(chunks, lens)])
    row = torch.repeat_interleave(torch.arange(len(chunks)), torch.tensor(lens))
    tables = _block_tables([c.block_ids for c in chunks], max_blocks)
    qsl = torch.zeros(len(chunks) + 1, dtype=torch.int64)
    qsl[1:] = torch.cumsum(torch.tensor(lens), 0)
    seq_lens = torch.tensor([c.start + n for c, n in zip(chunks, lens)], dtype=torch.int64)
    meta = PrefillMetadata(
        seq_lens=seq_lens.to(device),
        query_start_loc=qsl.to(device),
        block_tables=tables.to(device),
        slot_mappings=_slots(positions, tables, row, block_size).to(device),
        state_slots=torch.tensor([c.state_slots for c in chunks], dtype=torch.int64, device=device),
        has_initial_state=torch.tensor([c.start > 0 for c in chunks], dtype=torch.bool, device=device),
        logits_indices=(qsl[1:] - 1).to(device),
        num_reqs=len(chunks),
        max_seq_len=int(seq_lens.max()),
        snapshots=_snapshots(snapshots, lens, qsl, device),
    )
    return token_ids.to(device), positions.to(device), meta


def padded_row(q: int, bundle_slots: int, pools: int) -> UniformRow:
    """The inert row that pads a uniform step (see the module docstring)."""
    return UniformRow(token_ids=[0] * q, start=0, block_ids=[[] for _ in range(pools)],
                      state_slots=[0] * bundle_slots, prev_num_emitted=1)


@checked
def build_uniform(
    rows: list[UniformRow], num_reqs_padded: int, block_size: int, max_blocks: int,
    device: torch.device,
) -> tuple[Int[Tensor, "num_tokens"], Int[Tensor, "num_tokens"], UniformMetadata]:
    """token_ids, positions and metadata of a uniform step padded to num_reqs_padded rows."""
    q = len(rows[0].token_ids)
    nslots = len(rows[0].state_slots)
    if any(len(r.token_ids) != q or len(r.state_slots) != nslots for r in rows):
        raise ValueError("uniform step rows must all feed the same number of tokens")
    if not 1 <= len(rows) <= num_reqs_padded:
        raise ValueError(f"{len(rows)} rows do not fit num_reqs_padded={num_reqs_padded}")
    num_reqs, pools = len(rows), len(rows[0].block_ids)
    rows = rows + [padded_row(q, nslots, pools)] * (num_reqs_padded - num_reqs)
    # Plain Python on the host (a few ints per row), then one tensor per field: cheaper than
    # tensor arithmetic at decode batch sizes.
    positions = [p for r in rows for p in range(r.start, r.start + q)]
    slots = [[(ids[p // block_size] if ids else 0) * block_size + p % block_size
              for r in rows for ids in (r.block_ids[k],) for p in range(r.start, r.start + q)]
             for k in range(pools)]
    table = [[ids + [0] * (max_blocks - len(ids)) for r in rows for ids in (r.block_ids[k],)] for k in range(pools)]
    seq_lens = [r.start + q for r in rows]

    def as_tensor(x):
        return torch.tensor(x, dtype=torch.int64, device=device)

    meta = uniform_metadata(
        seq_lens=as_tensor(seq_lens),
        block_tables=as_tensor(table),
        slot_mappings=as_tensor(slots),
        state_slots=as_tensor([r.state_slots for r in rows]),
        prev_num_emitted=as_tensor([r.prev_num_emitted for r in rows]),
        q_len=q,
        max_seq_len=max(seq_lens),
        num_reqs=num_reqs,
    )
    return as_tensor([x for r in rows for x in r.token_ids]), as_tensor(positions), meta


@checked
def advance_decode(outcome: Int[Tensor, "num_reqs_padded outcome"], token_ids: Int[Tensor, "num_reqs_padded"],
                   positions: Int[Tensor, "num_reqs_padded"], slot_mappings: Int[Tensor, "kv_pools num_reqs_padded"],
                   seq_lens: Int[Tensor, "num_reqs_padded"],
                   block_tables: Int[Tensor, "kv_pools num_reqs_padded max_blocks"],
                   history: Int[Tensor, "decode_steps num_reqs_padded outcome"], step: Int[Tensor, "1"],
                   block_size: int) -> None:
    """In place, inside a decode graph (one token per row, no drafts: graphs/captured.CapturedSteps.decode):
    the step's outcome (token, num_emitted, finite per row: greedy, or sampled) kept at
    history[step] (and step + 1), and the next decode step's inputs as build_uniform gives them for
    rows one token further: the outcome's tokens, positions and sequence lengths + 1, the slots from
    the block tables. A padded row (block table row 0) stays in the null block. A position past the
    table's last block (after a run's last step, which the next fill overwrites) reads that last
    column, never past it."""
    history.index_copy_(0, step, outcome[None])
    step.add_(1)
    token_ids.copy_(outcome[:, 0])
    positions.add_(1)
    seq_lens.add_(1)
    blocks = (positions // block_size).clamp(max=block_tables.shape[-1] - 1)
    ids = block_tables.gather(2, blocks[None, :, None].expand(block_tables.shape[0], -1, 1))[..., 0]
    slot_mappings.copy_(ids * block_size + positions % block_size)
