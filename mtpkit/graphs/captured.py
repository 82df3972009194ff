"""Captured decode steps: the capture of step bodies handed to it, on static buffers, one
graph per num_reqs_padded, and their replay.

The bodies are written once, in the engine (engine/step_bodies.py, the `Bodies` protocol
below): eager mode calls the same functions. Two graphs per size n (each holds exactly
n * bundle query tokens):
- verify[n]: the verify body: target forward over the bundle tokens + logits at every bundle
  position + the greedy outcome (sampling/rejection.greedy_verify: tokens, num_emitted, finite
  per row; what an all-greedy step without controls reads back instead of sampling eagerly);
- propose[n]: the propose body: the drafter's proposal, reading the verify graph's hidden
  states and tokens and what rejection sampling emitted.
In a step where some row uses a generation control, a third graph, controls[n], runs the
controls body (sampling/controls.apply_controls) on verify[n]'s logits and tokens, the
controls' per-row inputs (static buffers: slot, flag, penalties, min_tokens' positions;
padded rows neutral), the controls' tables (read in place) and the draft limits, and returns
the processed logits and their greedy outcome (what an all-greedy controlled step reads back);
captured / traced when a step first needs it, like the others. A step without controls never
replays it.
In a step with a random row (temperature > 0) and no grammar, sample[n, filters, controlled] runs
the sample body (sampling/rejection.sampled_verify) on verify[n]'s logits, or on what controls[n]
left, with the rows' sampling settings in static buffers (written only when the step's requests
changed) and the parts of p the step runs fixed per graph (sampler.Filters; under LLM(compile=...)
Filters.for_graph: with or without top-k and top-p, at most four graphs per size to compile), and
writes its outcome into the proposal's inputs as verify[n] does for greedy steps. On CPU it is
traced like the others; on CUDA the body is called on the static buffers, uncaptured (see
`sample`). Rejection sampling runs eager (engine/runner.py) only for rows under a grammar or a
multi-token bad word, whose masks are applied on the host.
Without drafts, with num_scheduler_steps > 1 (CPU), a decode run replays decode[n, context]: the
verify body (with a random row, then the sample body), then step.metadata.advance_decode writing
the step's outcome into a history buffer and the next step's inputs over the rows' own (tokens,
positions, sequence lengths, slots),
so a run of steps is one fill, the replays back to back and one read-back (`decode`).
A proposal with grammar masks (structured outputs' constrained rows: each pass's mask needs the
previous pass's drafts on the host) calls the propose body directly on the same buffers.
On CPU, a prefill step of one chunk (state snapshots included) replays the prefill body, the
target's forward over the chunk padded at its end to a power of two (step.metadata.PrefillRows),
traced per (tokens, context bucket) like the proposal after a prefill (`prefill`).

How a graph is captured and replayed depends on the device:
- CUDA: warm up, capture largest size first into one shared memory pool, replay.
- CPU: the same bodies are traced (torch.jit.trace) on the same static buffers, and a replay
  runs the TorchScript graph: no Python per op, which at decode sizes is most of a step's
  cost. Attention reads K/V up to a fixed context length, so a CPU graph is keyed by
  (n, context bucket): the next power of two >= the longest sequence, traced when first
  needed (after a few direct calls, see CPU_TRACE_AFTER). Traced with inert rows in the
  buffers, so tracing writes only null storage.
- CPU, with tensor parallelism (the collectives are not traceable), a non-torch attention
  backend (Triton under its interpreter) or in debug mode (every step's shapes checked): the
  bodies are called directly on the buffers ("replay" = call).
Every mode runs the same static-buffer path, so CI covers every padding and metadata path;
`enforce_eager=True` calls the bodies on the step's own tensors, without this module.

The buffers are a persistent batch: a verify step writes its rows' values straight into them
from the host (`StaticBuffers.fill`: numpy views of the buffers on CPU, of pinned host copies
copied over per field on CUDA), no tensor built per field and copied; padded rows are reset
to inert values, and a block table row's stale tail is cleared only as far as it was written.
"""

import dataclasses
import warnings
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

from mtpkit.step.metadata import PrefillMetadata, UniformRow, advance_decode, build_uniform
from mtpkit.config import EngineConfig
from mtpkit.step.cache import CacheTensors
from mtpkit.sampling.controls import NEUTRAL_FLOATS, NEUTRAL_INTS, ControlInputs
from mtpkit.sampling.params import SamplingParams
from mtpkit.sampling.sampler import NEUTRAL_SAMPLING_FLOATS, NEUTRAL_SAMPLING_INTS, Filters, noise_steps, sampling_rows
from mtpkit.step.draft import DraftMasks
from mtpkit.shapes import Float, Int, Tensor, checked, is_debug
from mtpkit.graphs.plan import CapturePlan
from mtpkit.graphs.specialize import private_compilation_unit, specialized

MIN_CPU_CONTEXT = 64  # smallest context bucket of a CPU graph
# A CPU graph is traced on its (n, context)'s next replay after this many direct calls. Tracing
# and TorchScript's first, optimising runs cost hundreds of direct steps' worth of time, which
# a traced step repays only over a long run: a short generation stays on direct calls, a shape
# used this often is likely to go on being used. 0 traces at once.
CPU_TRACE_AFTER = 32
# Longer prefills propose by direct calls: a drafter's pass over the step is mostly arithmetic over the
# prompt, which a trace does not speed up, and each token bucket would be another trace.
MAX_TRACED_PREFILL = 512


class Bodies(Protocol):
    """The step bodies this module captures (engine/step_bodies.py: StepBodies). Each takes
    the context it attends over (an int a graph fixes), tensors, then the cache."""

    has_drafter: bool                    # a propose graph to capture
    proposal_needs_step_metadata: bool   # the proposal after a prefill reads the step's metadata: never traced
    traceable: bool                      # every op is visible to torch.jit.trace (no collectives, no Triton)
    vocab: int                           # the logits' columns (the sample body's noise steps)

    def verify(self, max_seq_len: int, token_ids, positions, slot_mappings, seq_lens, block_tables, state_slots,
               prev_num_emitted, draft_limit, cache: CacheTensors) -> tuple[Tensor, Tensor, Tensor]: ...

    def propose(self, max_seq_len: int, hidden, emitted, num_emitted, token_ids, positions, slot_mappings,
                seq_lens, block_tables, state_slots, prev_num_emitted, cache: CacheTensors,
                draft_masks: DraftMasks | None = None) -> Tensor: ...

    def prefill(self, max_seq_len: int, token_ids, positions, slot_mappings, seq_lens, block_tables, state_slots,
                num_real, has_initial_state, cache: CacheTensors, snapshot_rows=None, snapshot_index=None,
                snapshot_ids=None) -> Tensor: ...

    def prefill_proposal(self, max_seq_len: int, hidden, token_ids, next_tokens, positions, slot_mappings,
                         last_idx, block_tables, cache: CacheTensors, meta: PrefillMetadata | None = None,
                         draft_masks: DraftMasks | None = None) -> Tensor: ...

    def controls(self, logits, token_ids, ints, floats, counts, prompt_seen, static, stop,
                 draft_limit) -> tuple[Tensor, Tensor]: ...

    def sample(self, filters: Filters, logits, processed, token_ids, positions, draft_limit, floats,
               ints, steps) -> Tensor: ...


class SampledRequest(Protocol):
    """What a sample graph reads of a request (engine.request.Request): its settings and seed,
    fixed for its life (a step's buffers are rewritten only when its requests change)."""

    params: SamplingParams
    seed: int | None


# Tensor arguments of each body before the cache's (StaticBuffers.verify_inputs for verify).
VERIFY_INPUTS, PROPOSE_INPUTS, PREFILL_PROPOSAL_INPUTS, PREFILL_INPUTS = 8, 10, 7, 8


class LastVerify(NamedTuple):   # (a tuple: made every step, a frozen dataclass costs ~2 us more)
    """What the last `verify` ran, so that `propose` runs the matching body."""

    num_reqs_padded: int
    traced_context: int | None    # CPU: the context bucket of the trace it replayed; None otherwise
    max_seq_len: int              # the context its body attended over


@dataclasses.dataclass
class StaticBuffers:
    """Inputs every captured graph reads, sized for the largest graph."""

    token_ids: Tensor        # [max_reqs * bundle]
    positions: Tensor        # [max_reqs * bundle]
    slot_mappings: Tensor    # [kv_pools, max_reqs * bundle]
    seq_lens: Tensor         # [max_reqs]
    block_tables: Tensor     # [kv_pools, max_reqs, max_blocks]
    state_slots: Tensor      # [max_reqs, bundle]
    prev_num_emitted: Tensor     # [max_reqs]
    emitted: Tensor          # [max_reqs * bundle]  (propose: what the verify step emitted, per row)
    num_emitted: Tensor      # [max_reqs]           (propose: how many)
    draft_limit: Tensor      # [max_reqs]           (verify: drafts each row may accept; padded rows 0)
    # decode runs (num_scheduler_steps; bundle 1): each replay's outcome (greedy or sampled), and the run's
    # step the decode graph writes next (it counts itself; the host zeroes it before a run)
    history: Tensor          # [decode_steps, max_reqs, 3]
    decode_step: Tensor      # [1]
    # The host side `fill` writes: numpy views of these tensors (CPU) or of pinned host copies
    # of the verify fields (CUDA, copied over per field); and per pool and row, the block ids
    # its table row holds (unwritten while they stay the same; what a shorter row must clear).
    host: dict = dataclasses.field(default_factory=dict)
    pinned: dict = dataclasses.field(default_factory=dict)   # CUDA: the host copies as tensors
    table_rows: list = dataclasses.field(default_factory=list)

    # the fields a verify step fills from the host, in the verify body's argument order
    FILLED = ("token_ids", "positions", "slot_mappings", "seq_lens", "block_tables", "state_slots",
              "prev_num_emitted", "draft_limit")

    @classmethod
    def allocate(cls, max_reqs: int, bundle: int, max_blocks: int, pools: int, device,
                 decode_steps: int = 1) -> "StaticBuffers":
        def zeros(*shape):
            return torch.zeros(*shape, dtype=torch.int64, device=device)
        n = max_reqs * bundle
        buf = cls(zeros(n), zeros(n), zeros(pools, n), zeros(max_reqs), zeros(pools, max_reqs, max_blocks),
                  zeros(max_reqs, bundle), zeros(max_reqs), zeros(n), zeros(max_reqs), zeros(max_reqs),
                  zeros(decode_steps, max_reqs, 2 * bundle + 1), zeros(1))
        buf.make_inert(max_reqs, bundle)
        cpu = torch.device(device).type == "cpu"
        for name in cls.FILLED:
            t = getattr(buf, name)
            if not cpu:
                t = buf.pinned[name] = t.cpu().pin_memory()
            buf.host[name] = t.numpy()
        if cpu:   # (decode runs are CPU-only)
            buf.host["decode_step"] = buf.decode_step.numpy()
        return buf

    def make_inert(self, n: int, bundle: int) -> None:
        """Rows 0..n-1 become inert padded rows (see mtpkit/step/metadata.py): whatever runs on them
        reads and writes only the null block and the null slot."""
        self.token_ids[:n * bundle].zero_()
        self.positions[:n * bundle].copy_(torch.arange(bundle, device=self.positions.device).repeat(n))
        self.slot_mappings[:, :n * bundle].zero_()
        self.seq_lens[:n].fill_(bundle)
        self.block_tables[:, :n].zero_()
        self.state_slots[:n].zero_()
        self.prev_num_emitted[:n].fill_(1)
        self.emitted[:n * bundle].zero_()
        self.num_emitted[:n].fill_(1)
        self.draft_limit[:n].zero_()
        for written in self.table_rows:
            written[:n] = [[] for _ in range(min(n, len(written)))]
        for name, t in self.pinned.items():   # CUDA: the host copies inert too
            t.copy_(getattr(self, name))

    def fill(self, rows: list[UniformRow], n: int, bundle: int, block_size: int, draft_limits: list[int]) -> None:
        """Rows 0..len(rows)-1 hold `rows` (a verify step's, `draft_limits` theirs), rows up to n
        inert padding: the values the metadata builder (mtpkit/step/metadata.build_uniform) gives,
        computed in plain Python (a few ints per row) and written with one numpy assignment per
        field, no tensor per field; a block table row only when it changed (in steady state a
        request's table changes once per block_size tokens)."""
        h, R, B = self.host, len(rows), bundle
        T, N = R * B, n * B
        pools = len(rows[0].block_ids)
        if not self.table_rows:
            self.table_rows = [[[] for _ in range(self.seq_lens.shape[0])] for _ in range(pools)]
        toks, positions, seq_lens = [], [], []
        for r in rows:
            toks += r.token_ids
            positions += range(r.start, r.start + B)
            seq_lens.append(r.start + B)
        h["token_ids"][:T] = toks
        h["positions"][:T] = positions
        h["seq_lens"][:R] = seq_lens
        h["state_slots"][:R] = [r.state_slots for r in rows]
        h["prev_num_emitted"][:R] = [r.prev_num_emitted for r in rows]
        h["draft_limit"][:R] = draft_limits
        tables, slots = h["block_tables"], h["slot_mappings"]
        for p in range(pools):
            table, written, row_slots = tables[p], self.table_rows[p], []
            for i, r in enumerate(rows):
                ids = r.block_ids[p]
                if ids != written[i]:
                    table[i, :len(ids)] = ids
                    if len(written[i]) > len(ids):   # a shorter row than the last: clear the rest
                        table[i, len(ids):len(written[i])] = 0
                    written[i] = list(ids)
                row_slots += [ids[q // block_size] * block_size + q % block_size for q in range(r.start, r.start + B)]
            slots[p, :T] = row_slots
        if n > R:   # inert padded rows (mtpkit/step/metadata.py): token 0, the null block and slot
            h["token_ids"][T:N] = 0
            h["positions"][T:N] = list(range(B)) * (n - R)
            slots[:, T:N] = [q % block_size for q in range(B)] * (n - R)
            h["seq_lens"][R:n] = B
            h["state_slots"][R:n] = 0
            h["prev_num_emitted"][R:n] = 1
            h["draft_limit"][R:n] = 0
            for p in range(pools):
                written = self.table_rows[p]
                longest = max(len(w) for w in written[R:n])
                if longest:
                    tables[p, R:n, :longest] = 0
                    written[R:n] = [[] for _ in range(n - R)]
        if self.pinned:   # CUDA: the host copies' rows over, in stream order (no host wait)
            for dst, src in zip(self.verify_inputs(n, bundle), self._views(self.pinned, n, bundle)):
                dst.copy_(src, non_blocking=True)

    def inputs(self, n: int, bundle: int) -> tuple[Tensor, ...]:
        """The views a verify graph reads, in the verify body's argument order."""
        return self._views(vars(self), n, bundle)[:-1]

    def verify_inputs(self, n: int, bundle: int) -> tuple[Tensor, ...]:
        """The views a verify body reads: `inputs` and the draft limits."""
        return self._views(vars(self), n, bundle)

    @classmethod
    def _views(cls, fields: dict, n: int, bundle: int) -> tuple:
        """fields' (FILLED: tensors or their host copies) views of graph size n, in FILLED's order."""
        T = n * bundle
        f = fields
        return (f["token_ids"][:T], f["positions"][:T], f["slot_mappings"][:, :T], f["seq_lens"][:n],
                f["block_tables"][:, :n], f["state_slots"][:n], f["prev_num_emitted"][:n], f["draft_limit"][:n])


class RowValues:
    """Per-row values a body reads beside the step's buffers, as two static buffers: ints and
    floats [3, max_reqs] (the controls' inputs; the sampling settings). Written from the host
    through numpy views of them on CPU (no tensor op: each runs cache-cold after a graph), one copy
    each on CUDA; the rows past the real ones up to the graph size get `neutral` values."""

    def __init__(self, max_reqs: int, float_dtype: torch.dtype, device: torch.device,
                 neutral_ints: tuple, neutral_floats: tuple):
        self.ints = torch.zeros(3, max_reqs, dtype=torch.int64, device=device)
        self.floats = torch.zeros(3, max_reqs, dtype=float_dtype, device=device)
        self.neutral = (neutral_ints, neutral_floats)
        self.host = (self.ints.numpy(), self.floats.numpy()) if torch.device(device).type == "cpu" else None

    def write(self, ints: list[list[int]], floats: list[list[float]], n: int) -> None:
        """Rows 0..n-1: `ints[f][i]` and `floats[f][i]` (field f of real row i), then neutral ones."""
        R = len(ints[0])
        for k, (buf, rows, pad) in enumerate(zip((self.ints, self.floats), (ints, floats), self.neutral)):
            full = [row + [z] * (n - R) for row, z in zip(rows, pad)]
            if self.host is not None:
                self.host[k][:, :n] = full
            else:
                buf[:, :n].copy_(torch.tensor(full, dtype=buf.dtype))


class CapturedSteps:
    """The verify and propose bodies captured (CUDA) or traced (CPU) per graph size, their
    replays, and the proposal after a prefill (traced on CPU)."""

    def __init__(self, bodies: Bodies, cache: CacheTensors, ecfg: EngineConfig, plan: CapturePlan,
                 device: torch.device):
        self.bodies, self.cache, self.cfg, self.plan = bodies, cache, ecfg, plan
        self.device, self.bundle = device, ecfg.bundle
        self.buf = StaticBuffers.allocate(plan.sizes[-1], self.bundle, ecfg.max_blocks, len(cache.pool_windows),
                                          device, ecfg.num_scheduler_steps)
        self.cuda = device.type == "cuda"
        # CPU graphs are traced unless the trace would leave something out (Bodies.traceable).
        self.trace = not self.cuda and bodies.traceable
        self.trace_after = CPU_TRACE_AFTER
        self.verify_graphs: dict = {}     # CUDA: n -> graph; CPU: (n, context) -> traced function
        self.decode_graphs: dict = {}     # CPU: (n, context, Filters or None: greedy) -> traced decode body (`decode`)
        self.propose_graphs: dict = {}
        self.outputs: dict[int, dict[str, Tensor]] = {}
        self.pool = None
        self._last: LastVerify | None = None
        self._uses: dict = {}             # CPU: replays of each (n, context) (decode runs: ("decode", key)) so far
        self.prefill_proposal_graphs: dict = {}    # CPU: (tokens, n, context) -> traced proposal after a prefill
        self._prefill_proposal_uses: dict = {}
        self.prefill_graphs: dict = {}    # CPU: (tokens, context) -> the traced target forward of a prefill
        self._prefill_uses: dict = {}
        self.control_graphs: dict = {}    # n -> CUDA graph / traced controls body
        self._control_uses: dict = {}
        self._control_rows: RowValues | None = None   # ControlInputs.ints / .floats
        self._args: dict = {}             # ("verify" | "propose", n) -> the bodies' buffer and cache arguments
        self._cache_flat: tuple[Tensor, ...] | None = None
        self.compiler = None              # CPU: graphs.compiled.Compiler (LLM(compile=...)), else traces replay
        self.controls_outcome: Tensor | None = None   # the last `controls` replay's greedy outcome (every row)
        self._processed: Tensor | None = None          # ... and its processed logits (every row)
        self.sample_graphs: dict = {}     # CPU: (n, filters, controlled) -> traced sample body
        self._sample_uses: dict = {}
        self._sample_rows: RowValues | None = None   # sampler.sampling_rows' ints, floats
        self._sample_held: tuple = ((), 0, None)   # the requests, graph size and Filters the buffers hold
        self._noise_steps: Tensor | None = None   # sampler.noise_steps of the vocabulary

    # ---- what is traced or captured -------------------------------------------------------
    # A body with its context length fixed, over flat tensor arguments. The cache tensors are
    # arguments too, not constants a trace would hold: TorchScript's optimiser may fold ops on
    # constants, and the caches change between replays.
    def _flat(self, body, max_seq_len: int, inputs: int):
        return lambda *args: body(max_seq_len, *args[:inputs], self.cache.with_tensors(args[inputs:]))

    def _verify_fn(self, max_seq_len: int):
        """The verify body, then its greedy outcome written into the proposal's inputs (two more
        arguments after the verify inputs: `emitted`, `num_emitted`): an all-greedy step hands it
        on inside the graph, with no tensor op on the host between the two graphs (each such op
        runs with the caches cold after a graph, ~10 us). A step that samples overwrites them
        (`propose` given its tokens). Without a drafter nothing reads them: the two are left alone."""
        B, n_in, handed_on = self.bundle, VERIFY_INPUTS, self.bodies.has_drafter

        def verify(*args):
            hidden, logits, greedy = self.bodies.verify(max_seq_len, *args[:n_in], self.cache.with_tensors(args[n_in + 2:]))
            if handed_on:
                emitted, num_emitted = args[n_in], args[n_in + 1]
                emitted.view(-1, B).copy_(greedy[:, :B])
                num_emitted.copy_(greedy[:, B])
            return hidden, logits, greedy
        return verify

    def _decode_fn(self, max_seq_len: int, filters: Filters | None = None):
        """Decode runs (bundle 1, no drafter): the verify body, then its greedy outcome (or with
        `filters`, the sample body's outcome on its logits: three more arguments, the sampling
        rows' floats and ints and the noise steps) stored at the run's step in `history` (the
        two arguments after the verify inputs: history [steps, n, 3], decode_step [1], which it
        advances) and the next replay's inputs written over the rows' (step.metadata.advance_decode):
        no host work between two replays. Sampled tokens are keyed by (seed, position) as in one
        step (the positions advance in the graph), so a run draws what single steps draw."""
        n_in, bs = VERIFY_INPUTS, self.cfg.block_size
        extra = 2 if filters is None else 5

        def decode(*args):
            token_ids, positions, slot_mappings, seq_lens, block_tables = args[:5]
            hidden, logits, outcome = self.bodies.verify(max_seq_len, *args[:n_in],
                                                         self.cache.with_tensors(args[n_in + extra:]))
            if filters is not None:   # tokens, num_emitted, finite (no controls: every position is live)
                floats, ints, steps = args[n_in + 2:n_in + 5]
                outcome = self.bodies.sample(filters, logits, None, token_ids, positions, args[n_in - 1], floats, ints,
                                             steps)[:, :3]
            advance_decode(outcome, token_ids, positions, slot_mappings, seq_lens, block_tables, args[n_in],
                           args[n_in + 1], bs)
            return hidden, logits, outcome
        return decode

    def _controls_fn(self):
        """The controls body, then its greedy outcome written into the proposal's inputs (the last
        two arguments), as `_verify_fn` does: an all-greedy controlled step hands it on inside the
        graph. A step that samples overwrites them (the sample graph, or `propose` given its tokens)."""
        B, handed_on = self.bundle, self.bodies.has_drafter

        def controls(*args):
            processed, outcome = self.bodies.controls(*args[:-2])
            if handed_on:
                emitted, num_emitted = args[-2:]
                emitted.view(-1, B).copy_(outcome[:, :B])
                num_emitted.copy_(outcome[:, B])
            return processed, outcome
        return controls

    def _sample_fn(self, filters: Filters, controlled: bool):
        """The sample body for these filters, with or without the controls' processed logits (its
        second argument when `controlled`), then its outcome written into the proposal's inputs
        (the last two arguments), as `_verify_fn` does for greedy steps."""
        B, handed_on = self.bundle, self.bodies.has_drafter

        def sample(*args):
            logits, processed = args[0], (args[1] if controlled else None)
            rest = args[2:] if controlled else args[1:]
            out = self.bodies.sample(filters, logits, processed, *rest[:6])
            if handed_on:
                emitted, num_emitted = rest[6], rest[7]
                emitted.view(-1, B).copy_(out[:, :B])
                num_emitted.copy_(out[:, B])
            return out
        return sample

    def _propose_fn(self, max_seq_len: int):
        return self._flat(self.bodies.propose, max_seq_len, PROPOSE_INPUTS)

    def _prefill_fn(self, max_seq_len: int, snapshots: bool):
        """With `snapshots`: three more inputs (the snapshots' rows, token indices and ids) and the
        snapshot store's tensors after the cache's, which the graph writes."""
        if not snapshots:
            return self._flat(self.bodies.prefill, max_seq_len, PREFILL_INPUTS)
        n = PREFILL_INPUTS + 3
        return lambda *args: self.bodies.prefill(max_seq_len, *args[:PREFILL_INPUTS],
                                                 self.cache.with_tensors(args[n:], with_snapshots=True),
                                                 *args[PREFILL_INPUTS:n])

    def _prefill_proposal_fn(self, max_seq_len: int):
        return self._flat(self.bodies.prefill_proposal, max_seq_len, PREFILL_PROPOSAL_INPUTS)

    # The argument tuples are the same views of the same buffers and cache tensors every step
    # (what a CUDA graph's capture relies on too): made once per size.
    def _verify_args(self, n: int) -> tuple[Tensor, ...]:
        args = self._args.get(("verify", n))
        if args is None:
            B, buf = self.bundle, self.buf
            args = self._args["verify", n] = buf.verify_inputs(n, B) + (buf.emitted[:n * B], buf.num_emitted[:n]) \
                + self._cache_tensors()
        return args

    def _decode_args(self, n: int, sampled: bool) -> tuple[Tensor, ...]:
        """`_decode_fn`'s arguments of graph size n (`sampled`: with the sampling rows and the
        noise steps, which `_fill_sampling` and the vocabulary made first)."""
        args = self._args.get(("decode", n, sampled))
        if args is None:
            buf = self.buf
            sampling = ()
            if sampled:
                rows = self._sample_rows
                sampling = (rows.floats[:, :n], rows.ints[:, :n], self._noise())
            args = self._args["decode", n, sampled] = buf.verify_inputs(n, 1) + (buf.history[:, :n], buf.decode_step) \
                + sampling + self._cache_tensors()
        return args

    def _verify_views(self, n: int) -> tuple[Tensor, ...]:
        """(positions, token_ids, draft limits) of graph size n: what `verify` returns besides the
        graph's outputs, views made once (a view made per step is a host op)."""
        views = self._args.get(("views", n))
        if views is None:
            T, buf = n * self.bundle, self.buf
            views = self._args["views", n] = (buf.positions[:T], buf.token_ids[:T], buf.draft_limit[:n])
        return views

    def _propose_args(self, n: int, hidden: Float[Tensor, "num_tokens hidden"]) -> tuple[Tensor, ...]:
        rest = self._args.get(("propose", n))
        if rest is None:
            B, buf = self.bundle, self.buf
            rest = self._args["propose", n] = (buf.emitted[:n * B], buf.num_emitted[:n]) + buf.inputs(n, B) \
                + self._cache_tensors()
        return (hidden,) + rest

    def _cache_tensors(self) -> tuple[Tensor, ...]:
        if self._cache_flat is None:
            self._cache_flat = self.cache.tensors()
        return self._cache_flat

    # ---- capture ------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """CUDA: every size now, largest first, so the shared pool is sized by the first
        capture. Buffers hold inert padded rows while capturing: warm-up and capture write
        only null storage. (CPU graphs are traced when first needed: see `_cpu_graph`.)"""
        if not self.cuda:
            return
        max_len = self.cfg.max_positions
        verify, propose = self._verify_fn(max_len), self._propose_fn(max_len)
        self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for n in self.plan.capture_order():
            args = self._verify_args(n)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: allocator, kernels' first-launch work
                    hidden = verify(*args)[0]
                    if self.bodies.has_drafter:
                        propose(*self._propose_args(n, hidden))
            torch.cuda.current_stream().wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                hidden, logits, greedy = verify(*args)
            self.verify_graphs[n], self.outputs[n] = g, {"hidden": hidden, "logits": logits, "greedy": greedy}
            if self.bodies.has_drafter:
                gp = torch.cuda.CUDAGraph()
                with torch.cuda.graph(gp, pool=self.pool):
                    drafts = propose(*self._propose_args(n, hidden))
                self.propose_graphs[n] = gp
                self.outputs[n]["drafts"] = drafts
        torch.cuda.synchronize()

    def context_bucket(self, max_seq_len: int) -> int:
        """The context a CPU graph attends over for sequences up to max_seq_len."""
        cap = self.cfg.max_blocks * self.cfg.block_size
        return min(cap, max(MIN_CPU_CONTEXT, 1 << (max_seq_len - 1).bit_length()))

    def _cpu_graph(self, n: int, context: int):
        """The traced (verify, propose) functions of size n and this context, traced now if
        new: on inert rows (the buffers' real rows are filled after this)."""
        key = (n, context)
        if key not in self.verify_graphs:
            self.buf.make_inert(n, self.bundle)
            args = self._verify_args(n)
            verify = self._trace(self._verify_fn(context), args, f"verify_{n}_{context}")
            propose = None
            if self.bodies.has_drafter:
                hidden = verify(*args)[0]
                propose = self._trace(self._propose_fn(context), self._propose_args(n, hidden),
                                      f"propose_{n}_{context}")
            self.verify_graphs[key], self.propose_graphs[key] = verify, propose
        return self.verify_graphs[key], self.propose_graphs[key]

    def _trace(self, fn, args, name: str):
        """fn traced on args, then specialised to their shapes."""
        with warnings.catch_warnings():
            # Shape checks become constants, as they must: a graph is one shape. (A
            # data-dependent host read would break CUDA capture the same way; tests run
            # every graph path against enforce_eager.)
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            # But a tensor's value read on the host (.tolist(), .item(), int(t)) would be frozen
            # into the trace: that is an error, and the engine falls back to direct calls.
            warnings.filterwarnings("error", message="Converting a tensor to a Python (list|number|integer|float|index)",
                                    category=torch.jit.TracerWarning)
            with private_compilation_unit():
                traced = torch.jit.trace(fn, args, check_trace=False)
        # A graph replays only at the shape it was traced for: fold its shape bookkeeping.
        graph = specialized(traced, name)
        # LLM(compile=...): the trace serves until the compiled graph takes over (graphs.compiled).
        return graph if self.compiler is None else self.compiler.wrap(graph, fn, args, name)

    def _trace_failed(self, e: Exception) -> None:
        warnings.warn(f"mtpkit: tracing a CPU decode graph failed ({type(e).__name__}: {e}); "
                      "decode steps call the model directly from now on", RuntimeWarning, stacklevel=3)
        self.trace = False

    # ---- replay -------------------------------------------------------------------------
    @checked
    def verify(self, rows: list[UniformRow], num_reqs_padded: int, draft_limits: list[int]) -> tuple[
            Float[Tensor, "num_tokens hidden"], Float[Tensor, "num_tokens vocab"],
            Int[Tensor, "num_reqs_padded outcome"], Int[Tensor, "num_tokens"], Int[Tensor, "num_tokens"],
            Int[Tensor, "num_reqs_padded"]]:
        """Fill the buffers with the real rows (`draft_limits`: the drafts each may accept) and
        inert padded rows, replay verify[n]: (hidden, logits, greedy outcome, positions,
        token_ids, draft limits) of every row and bundle token, padded ones included."""
        n, B = num_reqs_padded, self.bundle
        self._check_rows(rows, n)
        max_seq_len = max(r.start for r in rows) + B
        if not self.cuda:
            verify, last = self._cpu_verify(n, max_seq_len)
        self._fill(rows, n, draft_limits)
        if self.cuda:
            self.verify_graphs[n].replay()
            self._last = LastVerify(n, None, self.cfg.max_positions)
            out = self.outputs[n]
        else:
            self._last = last
            hidden, logits, greedy = verify(*self._verify_args(n))
            out = self.outputs[n] = {"hidden": hidden, "logits": logits, "greedy": greedy}
        return (out["hidden"], out["logits"], out["greedy"]) + self._verify_views(n)

    def _check_rows(self, rows: list[UniformRow], n: int) -> None:
        if not 1 <= len(rows) <= n or any(len(r.token_ids) != self.bundle for r in rows):
            raise ValueError(f"{len(rows)} rows of {self.bundle} tokens do not fit graph size {n}")

    def _cpu_verify(self, n: int, max_seq_len: int):
        """CPU: (the verify graph of size n for sequences up to max_seq_len, or the body called
        directly, what `propose` must match). A graph is traced here when new, on inert rows:
        before the buffers are filled."""
        if self.trace and not is_debug():
            context = self.context_bucket(max_seq_len)
            uses = self._uses[n, context] = self._uses.get((n, context), 0) + 1
            if uses > self.trace_after:
                try:
                    return self._cpu_graph(n, context)[0], LastVerify(n, context, context)
                except Exception as e:  # noqa: BLE001 - the direct call below needs no tracer
                    self._trace_failed(e)
        return self._verify_fn(max_seq_len), LastVerify(n, None, max_seq_len)

    def _fill(self, rows: list[UniformRow], n: int, draft_limits: list[int]) -> None:
        self.controls_outcome = self._processed = None
        self.buf.fill(rows, n, self.bundle, self.cfg.block_size, draft_limits)
        if is_debug():   # the builder's metadata (shown in the trace) must be what the buffers hold
            self._check_fill(rows, n)

    def _cpu_decode(self, n: int, max_seq_len: int, filters: Filters | None):
        """CPU: the decode graph (`_decode_fn`) of size n for sequences up to max_seq_len (with
        `filters`: sampling those parts of p), or the body called directly; traced when new as
        `_cpu_verify`'s graphs are (on inert rows, before the buffers are filled)."""
        if self.trace and not is_debug():
            context = self.context_bucket(max_seq_len)
            key = (n, context, filters)
            uses = self._uses["decode", key] = self._uses.get(("decode", key), 0) + 1
            if uses > self.trace_after:
                try:
                    if key not in self.decode_graphs:
                        self.buf.make_inert(n, self.bundle)
                        name = f"decode_{n}_{context}" + ("" if filters is None else f"_{filters.code()}")
                        self.decode_graphs[key] = self._trace(self._decode_fn(context, filters),
                                                              self._decode_args(n, filters is not None), name)
                    return self.decode_graphs[key]
                except Exception as e:  # noqa: BLE001 - the direct call below needs no tracer
                    self._trace_failed(e)
        return self._decode_fn(max_seq_len, filters)

    def decode(self, rows: list[UniformRow], num_reqs_padded: int, steps: int,
               sampled: list | None = None) -> list[list[list[int]]]:
        """CPU, no drafts (bundle 1): `steps` decode steps in a row (EngineConfig.num_scheduler_steps):
        the buffers filled with `rows` once, then the decode graph (`_decode_fn`) replayed `steps`
        times, each replay writing the next one's inputs itself and its outcome into the history,
        read back once at the end: no host work between the replays but the calls. `sampled`:
        the rows' requests (SampledRequest, without controls or logprobs), whose settings the
        graph samples with (`sample`'s buffers and filters), else every row is greedy. The rows'
        blocks must hold every step's position. Returns each step's outcome of the real rows,
        [steps][num_reqs][token, 1, finite]. One graph serves the run: the context bucket of its
        last step. In debug mode every step's buffers are checked against build_uniform."""
        n, R = num_reqs_padded, len(rows)
        if self.cuda or self.bundle != 1 or steps > self.buf.history.shape[0]:
            raise ValueError(f"decode runs CPU graphs without drafts (bundle 1) of at most "
                             f"{self.buf.history.shape[0]} steps (num_scheduler_steps)")
        self._check_rows(rows, n)
        filters = None if sampled is None else self._fill_sampling(sampled, n)
        self.buf.host["decode_step"][0] = 0   # (a trace made now runs the body once: within the history too)
        decode = self._cpu_decode(n, max(r.start for r in rows) + steps, filters)
        self._fill(rows, n, [0] * R)
        self.buf.host["decode_step"][0] = 0
        args = self._decode_args(n, filters is not None)
        for j in range(steps):
            if j and is_debug():   # the rows one token further: the real ones and the padded ones
                tokens, pools = self.buf.history[j - 1, :n, 0].tolist(), len(rows[0].block_ids)
                self._check_fill([UniformRow([t], r.start + j, r.block_ids, r.state_slots, 1)
                                  for t, r in zip(tokens, rows)]
                                 + [UniformRow([t], j, [[] for _ in range(pools)], [0], 1) for t in tokens[R:]], n)
            decode(*args)
        # (a run is followed by no proposal, controls or sample graph: `_last` and `outputs` stay
        # the last verify's, and the next step fills the buffers anew)
        return self.buf.history[:steps, :R].tolist()

    def _check_fill(self, rows: list[UniformRow], n: int) -> None:
        tok, pos, meta = build_uniform(rows, n, self.cfg.block_size, self.cfg.max_blocks, self.device)
        want = (tok, pos, meta.slot_mappings, meta.seq_lens, meta.block_tables, meta.state_slots, meta.prev_num_emitted)
        for name, held, built in zip(StaticBuffers.FILLED, self.buf.inputs(n, self.bundle), want):
            if not torch.equal(held, built):
                raise AssertionError(f"StaticBuffers.fill wrote {name} {held.tolist()}, build_uniform gives "
                                     f"{built.tolist()}")

    @checked
    def propose(self, emitted: Int[Tensor, "num_reqs bundle"] | None = None,
                num_emitted: Int[Tensor, "num_reqs"] | None = None,
                draft_masks: DraftMasks | None = None) -> Int[Tensor, "num_reqs_padded num_spec"]:
        """Replay propose[n] for the rows filled by the last `verify`, which emitted
        emitted[i, :num_emitted[i]] (padded rows: one token 0), or without them its greedy outcome
        (every row's, padded ones included, whose inert rows emit one token), which the verify
        graph left in the buffers. The drafts of all n rows (the caller keeps the real ones). With
        `draft_masks` (constrained rows: each pass's mask is read back from the host) the body is
        called on the buffers instead."""
        last = self._last
        n, B, buf = last.num_reqs_padded, self.bundle, self.buf
        if emitted is not None:
            R = emitted.shape[0]
            buf.emitted[:R * B].view(R, B).copy_(emitted)
            buf.num_emitted[:R].copy_(num_emitted)
            if R < n:
                buf.emitted[R * B:n * B].zero_()
                buf.num_emitted[R:n].fill_(1)
        if draft_masks is not None:
            return self.bodies.propose(last.max_seq_len, self.outputs[n]["hidden"], buf.emitted[:n * B],
                                       buf.num_emitted[:n], *buf.inputs(n, B), self.cache, draft_masks)
        if self.cuda:
            self.propose_graphs[n].replay()
            return self.outputs[n]["drafts"]
        hidden = self.outputs[n]["hidden"]
        if last.traced_context is not None:
            return self.propose_graphs[n, last.traced_context](*self._propose_args(n, hidden))
        return self.bodies.propose(last.max_seq_len, hidden, buf.emitted[:n * B], buf.num_emitted[:n],
                                   *buf.inputs(n, B), self.cache)

    @checked
    def prefill(self, token_ids: Int[Tensor, "num_tokens"], positions: Int[Tensor, "num_tokens"],
                meta: PrefillMetadata, chunk_start: int) -> Float[Tensor, "num_tokens hidden"] | None:
        """CPU: the target's forward over a prefill step of one chunk (`chunk_start`: the tokens
        before it), traced like a decode step (the prefill body: step.metadata.PrefillRows):
        tokens padded at the end to a power of two (at least 16; the padding leaves the recurrent
        state as the chunk's last token left it), keyed by (tokens, context
        bucket, state snapshots written), traced after its first `trace_after` uses. None where
        the caller runs the model eager: before that, or a step of several chunks, longer than
        MAX_TRACED_PREFILL or past the block table, on CUDA, TP, a non-torch backend, debug mode."""
        T = token_ids.shape[0]
        if not self.trace or is_debug() or meta.num_reqs != 1 or T > MAX_TRACED_PREFILL:
            return None
        T_pad = max(16, 1 << (T - 1).bit_length())
        end = chunk_start + T_pad
        if end > self.cfg.max_blocks * self.cfg.block_size:
            return None
        snaps = meta.snapshots
        S = 0 if snaps is None else snaps.ids.shape[0]
        key = (T_pad, self.context_bucket(end), S)
        uses = self._prefill_uses[key] = self._prefill_uses.get(key, 0) + 1
        fn = self.prefill_graphs.get(key)
        if fn is None and uses <= self.trace_after:
            return None
        pad = T_pad - T
        ints = dict(dtype=torch.int64, device=token_ids.device)
        # (one chunk: a snapshot's token index into the step is its position in the padded row too)
        snap_args = () if not S else (snaps.rows, snaps.token_index, snaps.ids)
        cache = self._cache_tensors() + (self.cache.snapshot_tensors() if S else ())
        if fn is None:   # traced on an inert row (the null block and slot), like the decode graphs
            P, nslots = meta.slot_mappings.shape[0], meta.state_slots.shape[1]
            inert = (torch.zeros(T_pad, **ints), torch.arange(T_pad, **ints), torch.zeros(P, T_pad, **ints),
                     torch.full((1,), T_pad, **ints), torch.zeros_like(meta.block_tables), torch.zeros(1, nslots, **ints),
                     torch.full((1,), T_pad, **ints), torch.zeros(1, dtype=torch.bool, device=token_ids.device))
            # (snapshots: the ids this step writes anyway, which its replay below then writes right)
            inert_snaps = () if not S else (torch.zeros(S, **ints), torch.zeros(S, **ints), snaps.ids)
            name = f"prefill_{T_pad}_{key[1]}" + (f"_snapshots{S}" if S else "")
            try:
                fn = self.prefill_graphs[key] = self._trace(self._prefill_fn(key[1], bool(S)),
                                                            inert + inert_snaps + cache, name)
            except Exception as e:  # noqa: BLE001 - the caller runs the model eager
                self._trace_failed(e)
                return None
        # The padding's K/V go to the slots of its positions, as a verify step's drafts do: the
        # attention gathers every position up to the padded end (through the block table: the
        # row's own blocks, the null block past them), so no query reads a slot this step did not
        # write, and the row's later tokens overwrite them before anything keys their block.
        after = torch.arange(chunk_start + T, end, **ints)
        bs = self.cfg.block_size
        slots = torch.cat([meta.slot_mappings, meta.block_tables[:, 0, after // bs] * bs + after % bs], dim=1)
        return fn(F.pad(token_ids, (0, pad)), torch.arange(chunk_start, end, **ints), slots,
                  torch.full((1,), end, **ints), meta.block_tables, meta.state_slots, torch.full((1,), T, **ints),
                  meta.has_initial_state, *snap_args, *cache)[:T]

    @checked
    def prefill_proposal(
        self, max_seq_len: int,
        hidden: Float[Tensor, "num_tokens hidden"], token_ids: Int[Tensor, "num_tokens"],
        next_tokens: Int[Tensor, "num_tokens"], positions: Int[Tensor, "num_tokens"],
        slot_mappings: Int[Tensor, "kv_pools num_tokens"], last_idx: Int[Tensor, "draft_rows"],
        block_tables: Int[Tensor, "kv_pools draft_rows max_blocks"], meta: PrefillMetadata,
        draft_masks: DraftMasks | None = None,
    ) -> Int[Tensor, "draft_rows num_spec"]:
        """The prefill-proposal body's drafts for the prefills that finished (`last_idx`: their
        last tokens; arguments as the body's). On CPU, traced like a decode step: tokens padded
        to a power of two (at least 16; padding tokens write the null slot) and rows to a graph
        size (inert rows: null block), keyed by (tokens, rows, context bucket). Elsewhere (CUDA,
        where prefill runs eager; TP; debug; more tokens than MAX_TRACED_PREFILL; a drafter
        that runs over the step's own metadata, constrained rows' `draft_masks`) called directly."""
        T, R = hidden.shape[0], last_idx.shape[0]
        step = (hidden, token_ids, next_tokens, positions, slot_mappings, last_idx, block_tables)
        if (not self.trace or is_debug() or self.bodies.proposal_needs_step_metadata or R > self.plan.max_num_seqs
                or T > MAX_TRACED_PREFILL or draft_masks is not None):
            return self.bodies.prefill_proposal(max_seq_len, *step, self.cache, meta, draft_masks)
        T_pad, n, context = max(16, 1 << (T - 1).bit_length()), self.plan.dispatch(R), self.context_bucket(max_seq_len)
        key = (T_pad, n, context)
        uses = self._prefill_proposal_uses[key] = self._prefill_proposal_uses.get(key, 0) + 1
        fn = self.prefill_proposal_graphs.get(key)

        def pad(x, size, dim=0):
            if x.shape[dim] == size:
                return x
            shape = list(x.shape)
            shape[dim] = size - shape[dim]
            return torch.cat([x, x.new_zeros(shape)], dim=dim)
        if fn is None and uses > self.trace_after:
            P = block_tables.shape[0]
            inert = (hidden.new_zeros(T_pad, hidden.shape[1]),) + tuple(last_idx.new_zeros(T_pad) for _ in range(3)) + (
                last_idx.new_zeros(P, T_pad), last_idx.new_zeros(n), block_tables.new_zeros(P, n, block_tables.shape[2]))
            try:
                fn = self.prefill_proposal_graphs[key] = self._trace(self._prefill_proposal_fn(context), inert + self.cache.tensors(),
                                                            f"prefill_proposal_{T_pad}_{n}_{context}")
            except Exception as e:  # noqa: BLE001 - the direct call below needs no tracer
                self._trace_failed(e)
        if fn is None:
            return self.bodies.prefill_proposal(max_seq_len, *step, self.cache, meta)
        return fn(pad(hidden, T_pad), pad(token_ids, T_pad), pad(next_tokens, T_pad),
                  pad(positions, T_pad), pad(slot_mappings, T_pad, 1), pad(last_idx, n), pad(block_tables, n, 1),
                  *self.cache.tensors())[:R]

    @checked
    def controls(self, inputs: ControlInputs, tables: tuple[Tensor, ...]
                 ) -> Float[Tensor, "num_reqs_padded bundle vocab"]:
        """The controls body on the last `verify`'s logits and tokens: `inputs` (the real rows'; padded
        rows get neutral ones) written into static buffers, `tables` (ControlTables.tensors(), never
        reallocated) read in place; replays controls[n] (CUDA graph / CPU trace) or calls the body.
        Returns every row's processed logits; `controls_outcome` is then the body's greedy outcome
        of every row (Bodies.controls), until the next `verify`, also left in the proposal's inputs."""
        n, B = self._last.num_reqs_padded, self.bundle
        if self._control_rows is None:
            self._control_rows = RowValues(self.plan.sizes[-1], inputs.dtype, self.device, NEUTRAL_INTS, NEUTRAL_FLOATS)
        rows = self._control_rows
        rows.write(inputs.ints, inputs.floats, n)
        rest = self._args.get(("controls", n))
        if rest is None:   # (the tables are never reallocated)
            rest = self._args["controls", n] = (self.buf.token_ids[:n * B], rows.ints[:, :n], rows.floats[:, :n]) \
                + tuple(tables) + (self.buf.draft_limit[:n], self.buf.emitted[:n * B], self.buf.num_emitted[:n])
        args = (self.outputs[n]["logits"],) + rest
        if self.cuda:
            if n not in self.control_graphs:   # warming up on this step's rows writes what the replay will
                self.control_graphs[n], self.outputs[n]["controls"] = self._capture_small(self._controls_fn(), args)
            self.control_graphs[n].replay()
            self._processed, self.controls_outcome = self.outputs[n]["controls"]
            return self._processed
        fn = self._small_cpu_graph(self.control_graphs, self._control_uses, n, self._controls_fn, args,
                                   f"controls_{n}")
        self._processed, self.controls_outcome = fn(*args)
        return self._processed

    def _capture_small(self, body, args: tuple):
        """CUDA: `body` warmed up on a side stream, then captured on `args`: (graph, its outputs)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                body(*args)
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = body(*args)
        return g, out

    def _small_cpu_graph(self, graphs: dict, uses: dict, key, make, args: tuple, name: str):
        """CPU: what runs a graph made after the verify graph (controls, sample) for `key`: its trace,
        traced on this step's `args` at its use after `trace_after` (tracing writes what the call
        then writes), or `make()`, the body, called directly."""
        fn = graphs.get(key)
        if fn is None and self.trace and not is_debug():
            count = uses[key] = uses.get(key, 0) + 1
            if count > self.trace_after:
                try:
                    fn = graphs[key] = self._trace(make(), args, name)
                except Exception as e:  # noqa: BLE001 - the direct call needs no tracer
                    self._trace_failed(e)
        if fn is None or not self.trace or is_debug():
            fn = make()
        return fn

    def _fill_sampling(self, reqs: list, n: int) -> Filters:
        """The sampling buffers' rows 0..n-1: `reqs`' settings, then padded rows' neutral ones;
        rewritten only when the step's requests or graph size changed. Returns the parts of p the
        graph runs for them (the parts they ask for, padded rows greedy; compiled graphs: fewer
        variants, Filters.for_graph)."""
        last, last_n, filters = self._sample_held
        if last_n == n and len(last) == len(reqs) and all(a is b for a, b in zip(last, reqs)):
            return filters
        filters = Filters.of([r.params for r in reqs])
        filters = filters._replace(greedy=True) if self.compiler is None else filters.for_graph()
        floats, ints = sampling_rows([r.params for r in reqs], [r.seed for r in reqs])
        if self._sample_rows is None:
            self._sample_rows = RowValues(self.plan.sizes[-1], torch.float32, self.device,
                                              NEUTRAL_SAMPLING_INTS, NEUTRAL_SAMPLING_FLOATS)
        self._sample_rows.write(ints, floats, n)
        self._sample_held = (list(reqs), n, filters)
        return filters

    def _noise(self) -> Int[Tensor, "vocab"]:
        """sampler.noise_steps of the vocabulary, made once, outside any graph (see there why)."""
        if self._noise_steps is None:
            self._noise_steps = noise_steps(self.bodies.vocab, self.device)
        return self._noise_steps

    def _sample_args(self, n: int, controlled: bool) -> tuple[Tensor, ...]:
        """The sample body's arguments of graph size n, after the logits (and processed logits):
        views made once per size."""
        views = self._args.get(("sample", n))
        if views is None:
            T, buf = n * self.bundle, self.buf
            rows = self._sample_rows
            views = self._args["sample", n] = (buf.token_ids[:T], buf.positions[:T], buf.draft_limit[:n],
                                               rows.floats[:, :n], rows.ints[:, :n], self._noise(),
                                               buf.emitted[:T], buf.num_emitted[:n])
        logits = self.outputs[n]["logits"]
        return ((logits, self._processed) if controlled else (logits,)) + views

    @checked
    def sample(self, reqs: list, controlled: bool) -> Int[Tensor, "num_reqs_padded live_outcome"]:
        """The last `verify`'s rows sampled by their requests' settings (`reqs`: its real rows', SampledRequest),
        from its logits or, `controlled`, from what the last `controls` left: the outcome of every
        row (sampling/rejection.sampled_verify; padded rows are greedy), also left in the proposal's
        inputs. Replays sample[n, filters, controlled] (a CPU trace) or calls the body (CUDA: on the
        static buffers, uncaptured)."""
        n = self._last.num_reqs_padded
        filters = self._fill_sampling(reqs, n)
        key = (n, filters, controlled)
        args = self._sample_args(n, controlled)
        if self.cuda:
            # Called on the static buffers, not captured: a captured graph keeps its intermediates in
            # memory of its own, and this body's are [rows, bundle, vocab] int64 / float64 tensors
            # (the noise), per (size, filters) key: hundreds of MB each at a 152k vocabulary. Whether
            # capturing pays on a GPU (and in which memory pool) is measured there first (issue 33).
            return self._sample_fn(filters, controlled)(*args)
        fn = self._small_cpu_graph(self.sample_graphs, self._sample_uses, key,
                                   lambda: self._sample_fn(filters, controlled), args,
                                   f"sample_{n}_{filters.code()}" + ("_controlled" if controlled else ""))
        return fn(*args)

    def describe(self) -> str:
        mode = ("CUDA graphs" if self.cuda else "TorchScript traces on CPU" if self.trace
                else "static buffers (CPU replay)")
        compiled = f"; {self.compiler.describe()}" if self.compiler is not None and self.trace else ""
        return f"{mode}: {self.plan.describe()}{compiled}"
