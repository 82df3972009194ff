"""The bodies of a step, written once: what every mode runs, eager or captured.

- `verify`: the step's UniformMetadata from its tensors -> the target model -> logits at every
  bundle position, and the greedy outcome (sampling/rejection.greedy_verify), which an
  all-greedy step without controls takes as it is;
- `propose`: what rejection sampling emitted -> `verify_outcome` -> DraftInputs -> the
  drafter's proposal;
- `controls`: the generation controls' graph-safe part (sampling/controls.apply_controls) on
  the verify body's logits, the drafts it verified and the controls' tables, and the greedy
  outcome of what they leave (sampling/rejection.controlled_greedy_verify, which an all-greedy
  step takes as it is); replayed after `verify` only in a step where some row uses a control;
- `sample`: a step with random rows (and no grammar): rejection sampling of the verify body's
  logits, or of what the controls body left, by the rows' settings in static buffers
  (sampling/rejection.sampled_verify: the eager rejection's tokens, from the same noise);
- `prefill`: the target's forward over prefill chunks padded to one length (a captured prefill on
  CPU: step.metadata.PrefillRows; other prefills call the model on their own metadata, eager);
- `prefill_proposal`: the proposal after a prefill, for the prompts that finished; `observe`:
  a prefill chunk that samples nothing, for a drafter with its own KV (eager only).

`enforce_eager` calls them on the step's own tensors (engine/runner.py); graphs/captured.py
calls, traces (CPU) or captures (CUDA) the very same functions on its static buffers. So a
body reads only tensors, ints and the cache: no host reads of tensor values, no shapes
that depend on data, nothing a trace would freeze. Inside a body the real row count is not
known (a graph replays for any count up to its size): its metadata says `num_reqs` None.
"""

import torch

from mtpkit.sampling.controls import apply_controls
from mtpkit.sampling.rejection import controlled_greedy_verify, greedy_verify, sampled_verify
from mtpkit.sampling.sampler import Filters, SamplingTensors
from mtpkit.shapes import Bool, Float, Int, Tensor, checked
from mtpkit.step.cache import CacheTensors
from mtpkit.step.draft import Drafter, DraftMasks, draft_inputs, verify_outcome
from mtpkit.step.metadata import PrefillMetadata, PrefillRows, StateSnapshots, UniformMetadata, uniform_metadata


class StepBodies:
    """The step bodies of one model (and its drafter, or None). What graphs/captured.py is
    handed (its `Bodies` protocol) besides the bodies themselves: whether there is a drafter,
    whether its proposal needs the step's own metadata, and whether every op is traceable."""

    def __init__(self, model, drafter: Drafter | None, bundle: int):
        self.model, self.drafter, self.bundle = model, drafter, bundle
        self.has_drafter = drafter is not None
        self.vocab = model.cfg.vocab_size   # the logits' columns
        # A drafter that runs a model over the step's own metadata (not a tensor argument) is
        # never traced after a prefill.
        self.proposal_needs_step_metadata = drafter is not None and drafter.needs_step_metadata
        # A trace would leave out the model's collectives and kernels it cannot see into (Triton,
        # run by its interpreter on CPU).
        self.traceable = model.tp.size == 1 and model.ops.name == "torch"

    def _meta(self, slot_mappings, seq_lens, block_tables, state_slots, prev_num_emitted, max_seq_len
              ) -> UniformMetadata:
        return uniform_metadata(seq_lens, block_tables, slot_mappings, state_slots, prev_num_emitted,
                                q_len=self.bundle, max_seq_len=max_seq_len)

    # Typed like every boundary (checked when called directly in debug mode; a trace or a CUDA
    # graph records them once).
    @checked
    def verify(
        self, max_seq_len: int,
        token_ids: Int[Tensor, "num_tokens"], positions: Int[Tensor, "num_tokens"],
        slot_mappings: Int[Tensor, "kv_pools num_tokens"], seq_lens: Int[Tensor, "num_reqs_padded"],
        block_tables: Int[Tensor, "kv_pools num_reqs_padded max_blocks"],
        state_slots: Int[Tensor, "num_reqs_padded bundle"],
        prev_num_emitted: Int[Tensor, "num_reqs_padded"], draft_limit: Int[Tensor, "num_reqs_padded"],
        cache: CacheTensors,
    ) -> tuple[Float[Tensor, "num_tokens hidden"], Float[Tensor, "num_tokens vocab"],
               Int[Tensor, "num_reqs_padded 2*bundle+1"]]:
        """(hidden, logits, greedy): the logits at every bundle position and the step's outcome
        if every row is greedy without controls (sampling/rejection.greedy_verify: tokens,
        num_emitted, finite), so that such a step reads back one small int tensor. `draft_limit`:
        the drafts each row may accept (padded rows: 0)."""
        meta = self._meta(slot_mappings, seq_lens, block_tables, state_slots, prev_num_emitted, max_seq_len)
        hidden = self.model(token_ids, positions, meta, cache)
        logits = self.model.compute_logits(hidden)
        n = seq_lens.shape[0]
        greedy = greedy_verify(logits.view(n, self.bundle, -1), token_ids.view(n, self.bundle)[:, 1:], draft_limit)
        return hidden, logits, greedy

    @checked
    def prefill(
        self, max_seq_len: int,
        token_ids: Int[Tensor, "num_tokens"], positions: Int[Tensor, "num_tokens"],
        slot_mappings: Int[Tensor, "kv_pools num_tokens"], seq_lens: Int[Tensor, "num_reqs_padded"],
        block_tables: Int[Tensor, "kv_pools num_reqs_padded max_blocks"],
        state_slots: Int[Tensor, "num_reqs_padded row_slots"], num_real: Int[Tensor, "num_reqs_padded"],
        has_initial_state: Bool[Tensor, "num_reqs_padded"], cache: CacheTensors,
        snapshot_rows: Int[Tensor, "num_snapshots"] | None = None,
        snapshot_index: Int[Tensor, "num_snapshots"] | None = None,
        snapshot_ids: Int[Tensor, "num_snapshots"] | None = None,
    ) -> Float[Tensor, "num_tokens hidden"]:
        """A prefill step whose rows are chunks padded at their ends to one length (a captured
        prefill: step.metadata.PrefillRows; `seq_lens` count the padding, `num_real` the chunks'
        tokens): the target's final hidden states at every position, the padding's finite values
        nothing reads. Writes the chunks' KV and state like an eager prefill, and the state
        snapshots given (StateSnapshots' fields; token indices into the padded rows)."""
        n = seq_lens.shape[0]
        snaps = None if snapshot_ids is None else StateSnapshots(rows=snapshot_rows, token_index=snapshot_index,
                                                                 ids=snapshot_ids)
        meta = uniform_metadata(seq_lens, block_tables, slot_mappings, state_slots, torch.ones_like(num_real),
                                q_len=token_ids.shape[0] // n, max_seq_len=max_seq_len,
                                prefill=PrefillRows(num_real=num_real, has_initial_state=has_initial_state,
                                                    snapshots=snaps))
        return self.model(token_ids, positions, meta, cache)

    @checked
    def controls(
        self, logits: Float[Tensor, "num_tokens vocab"], token_ids: Int[Tensor, "num_tokens"],
        ints: Int[Tensor, "3 num_reqs_padded"], floats: Float[Tensor, "3 num_reqs_padded"],
        counts: Float[Tensor, "control_slots vocab"], prompt_seen: Bool[Tensor, "control_slots vocab"],
        static: Float[Tensor, "control_slots vocab"], stop: Bool[Tensor, "control_slots vocab"],
        draft_limit: Int[Tensor, "num_reqs_padded"],
    ) -> tuple[Float[Tensor, "num_reqs_padded bundle vocab"], Int[Tensor, "num_reqs_padded 3*bundle+1"]]:
        """After a verify body: its logits with the controls applied at every bundle position
        (the drafts d_1..d_k are the step's tokens after each row's first), and the step's outcome
        if every row is greedy (sampling/rejection.controlled_greedy_verify on them), which such a
        step reads back instead of running the rejection and the checks eagerly."""
        n = ints.shape[1]
        logits, drafts = logits.view(n, self.bundle, -1), token_ids.view(n, self.bundle)[:, 1:]
        processed = apply_controls(logits, drafts, ints, floats, counts, prompt_seen, static, stop)
        return processed, controlled_greedy_verify(logits, processed, drafts, draft_limit)

    @checked
    def sample(
        self, filters: Filters, logits: Float[Tensor, "num_tokens vocab"],
        processed: Float[Tensor, "num_reqs_padded bundle vocab"] | None, token_ids: Int[Tensor, "num_tokens"],
        positions: Int[Tensor, "num_tokens"], draft_limit: Int[Tensor, "num_reqs_padded"],
        floats: Float[Tensor, "3 num_reqs_padded"], ints: Int[Tensor, "3 num_reqs_padded"],
        steps: Int[Tensor, "vocab"],
    ) -> Int[Tensor, "num_reqs_padded live_outcome"]:   # (no argument names the bundle when processed is None)
        """After a verify body (and the controls body: `processed`; None where no row uses a
        control): the step's outcome sampled by each row's settings (`floats`, `ints`:
        sampler.sampling_rows' layout; `filters`: the parts of p the step runs, fixed per graph;
        `steps`: sampler.noise_steps),
        the drafts d_1..d_k being the step's tokens after each row's first and bundle index j
        sampling the position after token j's (sampling/rejection.sampled_verify)."""
        n, B = ints.shape[1], self.bundle
        logits = logits.view(n, B, -1)
        st = SamplingTensors.from_buffers(floats, ints, filters)
        return sampled_verify(logits, logits if processed is None else processed, token_ids.view(n, B)[:, 1:],
                              draft_limit, st, ints[2], positions.view(n, B) + 1, steps)

    @checked
    def propose(
        self, max_seq_len: int,
        hidden: Float[Tensor, "num_tokens hidden"], emitted: Int[Tensor, "num_tokens"],
        num_emitted: Int[Tensor, "num_reqs_padded"],
        token_ids: Int[Tensor, "num_tokens"], positions: Int[Tensor, "num_tokens"],
        slot_mappings: Int[Tensor, "kv_pools num_tokens"], seq_lens: Int[Tensor, "num_reqs_padded"],
        block_tables: Int[Tensor, "kv_pools num_reqs_padded max_blocks"],
        state_slots: Int[Tensor, "num_reqs_padded bundle"],
        prev_num_emitted: Int[Tensor, "num_reqs_padded"], cache: CacheTensors,
        draft_masks: DraftMasks | None = None,
    ) -> Int[Tensor, "num_reqs_padded num_spec"]:
        """After a verify step that emitted emitted[i*bundle : i*bundle + num_emitted[i]] for
        row i (padded rows: one token 0): the drafts of every row (`draft_masks`: the
        constrained rows' grammar masks per pass, eager only)."""
        n = num_emitted.shape[0]
        next_tokens, last_idx = verify_outcome(token_ids.view(n, -1), emitted.view(n, -1), num_emitted)
        meta = self._meta(slot_mappings, seq_lens, block_tables, state_slots, prev_num_emitted, max_seq_len)
        inp = draft_inputs(hidden, token_ids, next_tokens, positions, slot_mappings, last_idx, block_tables,
                           max_seq_len, meta, draft_masks)
        return self.drafter.propose(inp, cache)

    @checked
    def prefill_proposal(
        self, max_seq_len: int,
        hidden: Float[Tensor, "num_tokens hidden"], token_ids: Int[Tensor, "num_tokens"],
        next_tokens: Int[Tensor, "num_tokens"], positions: Int[Tensor, "num_tokens"],
        slot_mappings: Int[Tensor, "kv_pools num_tokens"], last_idx: Int[Tensor, "draft_rows"],
        block_tables: Int[Tensor, "kv_pools draft_rows max_blocks"], cache: CacheTensors,
        meta: PrefillMetadata | None = None, draft_masks: DraftMasks | None = None,
    ) -> Int[Tensor, "draft_rows num_spec"]:
        """After a prefill: the drafts of the prompts that finished (`last_idx`: their last
        tokens, `block_tables`: theirs). `meta` the step's own, None when traced; `draft_masks`
        as `propose`'s."""
        inp = draft_inputs(hidden, token_ids, next_tokens, positions, slot_mappings, last_idx, block_tables,
                           max_seq_len, meta, draft_masks)
        return self.drafter.propose(inp, cache)

    def observe(
        self, max_seq_len: int,
        hidden: Float[Tensor, "num_tokens hidden"], token_ids: Int[Tensor, "num_tokens"],
        next_tokens: Int[Tensor, "num_tokens"], positions: Int[Tensor, "num_tokens"],
        slot_mappings: Int[Tensor, "kv_pools num_tokens"], last_idx: Int[Tensor, "draft_rows"],
        block_tables: Int[Tensor, "kv_pools draft_rows max_blocks"], cache: CacheTensors,
        meta: PrefillMetadata | None = None,
    ) -> None:
        """A prefill step that finished no prompt: the drafter reads it (its own KV), drafts nothing."""
        inp = draft_inputs(hidden, token_ids, next_tokens, positions, slot_mappings, last_idx, block_tables,
                           max_seq_len, meta)
        self.drafter.observe(inp, cache)


def verify_inputs(token_ids: Int[Tensor, "num_tokens"], positions: Int[Tensor, "num_tokens"],
                  meta: UniformMetadata) -> tuple:
    """A verify step's own tensors in the bodies' argument order, after max_seq_len (what the
    static buffers of graphs/captured.py hold in the same order)."""
    return (token_ids, positions, meta.slot_mappings, meta.seq_lens, meta.block_tables, meta.state_slots,
            meta.prev_num_emitted)
