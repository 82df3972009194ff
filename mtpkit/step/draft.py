"""The drafter interface: what a drafter reads after a target step, what it returns, and what
it declares before any weight is read.

After every target step the engine hands the drafter a `DraftInputs` (the step's tokens,
positions, the target's final hidden states, the token after each position and each draft
row's last committed index) and gets `[draft_rows, num_spec]` greedy drafts back. Its rows
are not the step's own after a prefill: they are the prompts that finished (`draft_rows`). After a
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
Drafts are greedy (argmax): the rejection sampler treats them as one-hot proposals. In a step
with constrained requests (structured outputs) the argmax of each pass is taken over logits
masked with the grammar state after the drafts before it (`DraftMasks`, in DraftInputs); those
masks depend on the drafts' values, so such a proposal runs eagerly, never captured.
"""


import torch

from mtpkit.shapes import Float, Int, Tensor, checked, shaped_dataclass
from mtpkit.step.cache import CacheTensors
from mtpkit.step.metadata import PrefillMetadata, UniformMetadata


class DraftMasks:
    """The grammar masks of one proposal's passes (structured outputs: made by
    mtpkit/structured/draft_masks.py). Pass j (0-based) of a drafter calls it with draft j - 1
    of every draft row (None at pass 0) right before its argmax, and applies the mask it
    returns to the pass's logits (a sampling.bitmask.DraftMask; None: no row is constrained now).
    It reads the drafts on the host (a round trip per pass), which a trace or a CUDA graph
    could not replay: only eager proposals get one."""

    def __call__(self, j: int, previous: Int[Tensor, "draft_rows"] | None):  # noqa: F821 - a jaxtyping dimension, not a name
        raise NotImplementedError


@shaped_dataclass(frozen=True)
class DraftInputs:
    """One target step, as a drafter reads it. Rows (`draft_rows`) are the requests to draft
    for: a verify step's every row, padded ones included; a prefill's prompts that finished
    (padded to a graph size when traced). Built by `draft_inputs` only."""

    hidden: Float[Tensor, "num_tokens hidden"]          # the target's final (post-norm) hidden states
    token_ids: Int[Tensor, "num_tokens"]                # the tokens the step fed
    next_tokens: Int[Tensor, "num_tokens"]              # the token after each position
    positions: Int[Tensor, "num_tokens"]
    slot_mappings: Int[Tensor, "kv_pools num_tokens"]   # the KV slot of every position, in each pool
    # Each draft row's last committed position, as a flat index into the step's tokens: after a
    # verify step its last accepted bundle position, after a prefill its prompt's last token.
    last_idx: Int[Tensor, "draft_rows"]
    block_tables: Int[Tensor, "kv_pools draft_rows max_blocks"]
    max_seq_len: int                                    # longest sequence of the step
    # The step's own metadata, for a drafter that runs a model over the step's tokens. None in
    # a traced prefill proposal (only drafters with `needs_step_metadata` False are traced there).
    meta: PrefillMetadata | UniformMetadata | None = None
    # Per-pass grammar masks of the constrained rows; None (always, when captured): unmasked.
    draft_masks: DraftMasks | None = None


class Drafter:
    """Base of every drafter. `propose` after a step that samples; `observe` after a prefill
    chunk that samples nothing (a drafter with its own KV fills it there)."""

    num_spec: int
    needs_step_metadata = False

    def propose(self, inp: DraftInputs, cache: CacheTensors) -> Int[Tensor, "draft_rows num_spec"]:
        raise NotImplementedError

    def observe(self, inp: DraftInputs, cache: CacheTensors) -> None:
        pass

    def own_modules(self) -> list:
        """The nn.Modules that hold this drafter's own weights, which EngineArgs.draft_dtype casts
        (only for a DraftSetup with own_dtype): none by default."""
        return []


def draft_inputs(
    hidden: Float[Tensor, "num_tokens hidden"], token_ids: Int[Tensor, "num_tokens"],
    next_tokens: Int[Tensor, "num_tokens"], positions: Int[Tensor, "num_tokens"],
    slot_mappings: Int[Tensor, "kv_pools num_tokens"], last_idx: Int[Tensor, "draft_rows"],
    block_tables: Int[Tensor, "kv_pools draft_rows max_blocks"], max_seq_len: int,
    meta: PrefillMetadata | UniformMetadata | None = None, draft_masks: DraftMasks | None = None,
) -> DraftInputs:
    """The one place a DraftInputs is made: the step bodies' (engine/step_bodies.py) after a
    verify step (`last_idx`, `next_tokens` from `verify_outcome`) and after a prefill (the
    finished prompts' last tokens and block tables, the token after every position)."""
    return DraftInputs(hidden=hidden, token_ids=token_ids, next_tokens=next_tokens, positions=positions,
                       slot_mappings=slot_mappings, last_idx=last_idx, block_tables=block_tables,
                       max_seq_len=max_seq_len, meta=meta, draft_masks=draft_masks)


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


