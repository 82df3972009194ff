"""Attention metadata: typed dataclasses built by pure functions from a scheduled step.

Two layouts, and only two:
- PREFILL: ragged chunks of prompts, packed token-major (`query_start_loc`), run eager.
- UNIFORM: every row feeds the same number of query tokens (`q_len`), request-major. A verify
  step has q_len = bundle tokens per row (num_spec + 1; 1 without speculation), a drafter's
  one-token pass has q_len = 1 (its own dimension, so a trace never reads "bundle=1").
  Rows are padded to `num_reqs_padded` (a captured graph size). Padded rows are real rows
  that point at null storage: token 0, positions 0..q-1, seq_len q, block-table row of the
  null block (0), state slots of the null slot (0), prev_num_emitted 1. They compute finite
  garbage into null storage and are never sampled.

Builders run on the host (lists -> one tensor each) and move every tensor to the device once.
"""

import dataclasses

import torch

from ..shapes import Bool, Int, Tensor, checked, shaped_dataclass


@dataclasses.dataclass(frozen=True)
class PrefillChunk:
    """One request's share of a prefill step: tokens at positions start .. start+len-1."""

    token_ids: list[int]
    start: int                 # tokens of this request already in the caches
    block_ids: list[int]
    state_slots: list[int]     # the request's state slots (empty: the model keeps no state)


@dataclasses.dataclass(frozen=True)
class UniformRow:
    """One request's row of a uniform step."""

    token_ids: list[int]       # q tokens: [last sampled, drafts...] (verify) or [draft] (MTP)
    start: int                 # position of token_ids[0]
    block_ids: list[int]
    state_slots: list[int]     # the request's bundle state slots (verify); ignored by draft passes
    prev_num_emitted: int          # tokens accepted for this request in its previous step (>= 1)


@shaped_dataclass(frozen=True)
class PrefillMetadata:
    seq_lens: Int[Tensor, "num_reqs"]                  # cached prefix + this chunk
    query_start_loc: Int[Tensor, "num_reqs+1"]
    block_table: Int[Tensor, "num_reqs max_blocks"]
    slot_mapping: Int[Tensor, "num_tokens"]            # KV slot of every token
    state_slots: Int[Tensor, "num_reqs bundle"]        # each request's state slots
    has_initial_state: Bool[Tensor, "num_reqs"]        # a previous chunk left state behind
    logits_indices: Int[Tensor, "num_reqs"]            # the last token of every chunk
    num_reqs: int
    max_seq_len: int                                   # host copy, so attention needs no sync


@shaped_dataclass(frozen=True)
class UniformMetadata:
    seq_lens: Int[Tensor, "num_reqs_padded"]           # context including this step's tokens
    block_table: Int[Tensor, "num_reqs_padded max_blocks"]
    slot_mapping: Int[Tensor, "num_tokens"]
    state_slots: Int[Tensor, "num_reqs_padded q_len"]  # verify: the request's bundle slots
    prev_num_emitted: Int[Tensor, "num_reqs_padded"]
    num_reqs: int                                      # real rows; the rest are padding
    num_reqs_padded: int
    q_len: int                                         # query tokens per row
    max_seq_len: int
    # The KV-cache slot of every position 0..ctx_len-1 of each row, or None: computed from the
    # block table. An MTP proposal computes it once for all its passes (speculative.mtp); the torch
    # attention then gathers through it (the Triton kernel walks the block table either way).
    kv_slots: Int[Tensor, "num_reqs_padded ctx_len"] | None = None

    @property
    def num_tokens(self) -> int:
        return self.num_reqs_padded * self.q_len


def _block_table(rows: list[list[int]], max_blocks: int) -> Tensor:
    table = torch.zeros(len(rows), max_blocks, dtype=torch.int64)
    for i, ids in enumerate(rows):
        if ids:
            table[i, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
    return table


def _slots(positions: Int[Tensor, "num_tokens"], table: Int[Tensor, "num_reqs max_blocks"],
           row_of_token: Int[Tensor, "num_tokens"], block_size: int) -> Int[Tensor, "num_tokens"]:
    blocks = table[row_of_token, positions // block_size]
    return blocks * block_size + positions % block_size


@checked
def build_prefill(
    chunks: list[PrefillChunk], block_size: int, max_blocks: int, device: torch.device
) -> tuple[Int[Tensor, "num_tokens"], Int[Tensor, "num_tokens"], PrefillMetadata]:
    """token_ids, positions and metadata of a prefill step."""
    lens = [len(c.token_ids) for c in chunks]
    for c in chunks:
        need = -(-(c.start + len(c.token_ids)) // block_size)
        assert len(c.block_ids) >= need, "scheduler must allocate blocks before building"
    token_ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.int64)
    positions = torch.cat([torch.arange(c.start, c.start + n) for c, n in zip(chunks, lens)])
    row = torch.repeat_interleave(torch.arange(len(chunks)), torch.tensor(lens))
    table = _block_table([c.block_ids for c in chunks], max_blocks)
    qsl = torch.zeros(len(chunks) + 1, dtype=torch.int64)
    qsl[1:] = torch.cumsum(torch.tensor(lens), 0)
    seq_lens = torch.tensor([c.start + n for c, n in zip(chunks, lens)], dtype=torch.int64)
    meta = PrefillMetadata(
        seq_lens=seq_lens.to(device),
        query_start_loc=qsl.to(device),
        block_table=table.to(device),
        slot_mapping=_slots(positions, table, row, block_size).to(device),
        state_slots=torch.tensor([c.state_slots for c in chunks], dtype=torch.int64, device=device),
        has_initial_state=torch.tensor([c.start > 0 for c in chunks], dtype=torch.bool, device=device),
        logits_indices=(qsl[1:] - 1).to(device),
        num_reqs=len(chunks),
        max_seq_len=int(seq_lens.max()),
    )
    return token_ids.to(device), positions.to(device), meta


def padded_row(q: int, bundle_slots: int) -> UniformRow:
    """The inert row that pads a uniform step (see the module docstring)."""
    return UniformRow(token_ids=[0] * q, start=0, block_ids=[], state_slots=[0] * bundle_slots,
                      prev_num_emitted=1)


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
    num_reqs = len(rows)
    rows = rows + [padded_row(q, nslots)] * (num_reqs_padded - num_reqs)
    # Plain Python on the host (a few ints per row), then one tensor per field: cheaper than
    # tensor arithmetic at decode batch sizes.
    positions, slots, table = [], [], []
    for r in rows:
        pos = range(r.start, r.start + q)
        positions.extend(pos)
        slots.extend((r.block_ids[p // block_size] if r.block_ids else 0) * block_size + p % block_size
                     for p in pos)
        table.append(r.block_ids + [0] * (max_blocks - len(r.block_ids)))
    seq_lens = [r.start + q for r in rows]

    def as_tensor(x):
        return torch.tensor(x, dtype=torch.int64, device=device)

    meta = UniformMetadata(
        seq_lens=as_tensor(seq_lens),
        block_table=as_tensor(table),
        slot_mapping=as_tensor(slots),
        state_slots=as_tensor([r.state_slots for r in rows]),
        prev_num_emitted=as_tensor([r.prev_num_emitted for r in rows]),
        num_reqs=num_reqs,
        num_reqs_padded=num_reqs_padded,
        q_len=q,
        max_seq_len=max(seq_lens),
    )
    return as_tensor([x for r in rows for x in r.token_ids]), as_tensor(positions), meta
