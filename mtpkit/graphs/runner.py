"""Captured verify steps: static buffers, one graph per num_reqs_padded, replay.

Two graphs per size n (each holds exactly n * bundle query tokens):
- verify[n]: target forward over the bundle tokens + logits at every bundle position;
- propose[n]: the MTP passes (pass 1 over the bundle positions, then num_spec - 1 draft
  passes), reading the verify graph's hidden states and the accepted counts.
Rejection sampling runs between them, eager (it draws from per-request generators).

On CUDA: warm up, capture largest size first into one shared memory pool, replay. On CPU the
same static-buffer path runs the captured callables directly ("replay" = call), so CI covers
every padding and metadata path; `enforce_eager=True` bypasses this runner entirely.
"""

import dataclasses

import torch

from ..attn.metadata import UniformMetadata, UniformRow, build_uniform
from ..config import EngineConfig
from ..engine.cache import CacheTensors
from ..models.qwen3_next import Qwen3NextForCausalLM
from ..shapes import Float, Int, Tensor, checked
from ..spec.mtp import MTPProposer
from .plan import CapturePlan


@dataclasses.dataclass
class StaticBuffers:
    """Inputs every captured graph reads, sized for the largest graph."""

    token_ids: Tensor        # [max_reqs * bundle]
    positions: Tensor        # [max_reqs * bundle]
    slot_mapping: Tensor     # [max_reqs * bundle]
    seq_lens: Tensor         # [max_reqs]
    block_table: Tensor      # [max_reqs, max_blocks]
    state_slots: Tensor      # [max_reqs, bundle]
    num_accepted: Tensor     # [max_reqs]
    next_tokens: Tensor      # [max_reqs * bundle]  (propose: the token after each position)
    last_idx: Tensor         # [max_reqs]           (propose: last accepted token of each row)

    @classmethod
    def allocate(cls, max_reqs: int, bundle: int, max_blocks: int, device) -> "StaticBuffers":
        def z(*shape):
            return torch.zeros(*shape, dtype=torch.int64, device=device)
        n = max_reqs * bundle
        # Every row starts as an inert padded row (see attn.metadata).
        return cls(z(n), torch.arange(bundle, device=device).repeat(max_reqs), z(n),
                   torch.full((max_reqs,), bundle, dtype=torch.int64, device=device),
                   z(max_reqs, max_blocks), z(max_reqs, bundle),
                   torch.ones(max_reqs, dtype=torch.int64, device=device), z(n),
                   torch.arange(max_reqs, device=device) * bundle)

    def meta(self, n: int, bundle: int, max_seq_len: int) -> UniformMetadata:
        """Metadata over the first n rows: views of the buffers, so a graph sees new values."""
        return UniformMetadata(self.seq_lens[:n], self.block_table[:n], self.slot_mapping[:n * bundle],
                               self.state_slots[:n], self.num_accepted[:n], n, n, bundle, max_seq_len)


class GraphRunner:
    def __init__(self, model: Qwen3NextForCausalLM, cache: CacheTensors, ecfg: EngineConfig,
                 plan: CapturePlan, proposer: MTPProposer | None, device: torch.device):
        self.model, self.cache, self.cfg, self.plan = model, cache, ecfg, plan
        self.proposer, self.device, self.bundle = proposer, device, ecfg.bundle
        self.buf = StaticBuffers.allocate(plan.sizes[-1], self.bundle, ecfg.max_blocks, device)
        self.cuda = device.type == "cuda"
        self.verify_graphs: dict[int, object] = {}
        self.propose_graphs: dict[int, object] = {}
        self.outputs: dict[int, dict[str, Tensor]] = {}
        self.pool = None

    # ---- the captured bodies --------------------------------------------------------------
    def _verify_body(self, n: int, max_seq_len: int) -> dict[str, Tensor]:
        B, buf = self.bundle, self.buf
        meta = buf.meta(n, B, max_seq_len)
        hidden = self.model(buf.token_ids[:n * B], buf.positions[:n * B], meta, self.cache)
        return {"hidden": hidden, "logits": self.model.compute_logits(hidden)}

    def _propose_body(self, n: int, max_seq_len: int, hidden: Float[Tensor, "num_tokens hidden"]
                      ) -> dict[str, Tensor]:
        B, buf = self.bundle, self.buf
        meta = buf.meta(n, B, max_seq_len)
        drafts = self.proposer.propose(hidden, buf.next_tokens[:n * B], buf.positions[:n * B], meta,
                                       self.cache, buf.last_idx[:n], buf.block_table[:n])
        return {"drafts": drafts}

    # ---- capture ------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Largest size first, so the shared pool is sized by the first capture. Buffers hold
        inert padded rows while capturing: warm-up and capture write only null storage."""
        max_len = self.cfg.max_positions
        if not self.cuda:
            return  # CPU: the bodies are called directly at replay
        self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for n in self.plan.capture_order():
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: allocator, kernels' first-launch work
                    out = self._verify_body(n, max_len)
                    if self.proposer is not None:
                        self._propose_body(n, max_len, out["hidden"])
            torch.cuda.current_stream().wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                out = self._verify_body(n, max_len)
            self.verify_graphs[n], self.outputs[n] = g, dict(out)
            if self.proposer is not None:
                gp = torch.cuda.CUDAGraph()
                with torch.cuda.graph(gp, pool=self.pool):
                    pout = self._propose_body(n, max_len, out["hidden"])
                self.propose_graphs[n] = gp
                self.outputs[n].update(pout)
        torch.cuda.synchronize()

    # ---- replay -------------------------------------------------------------------------
    @checked
    def verify(self, rows: list[UniformRow], num_reqs_padded: int) -> tuple[
            Float[Tensor, "num_tokens hidden"], Float[Tensor, "num_tokens vocab"], Int[Tensor, "num_tokens"]]:
        """Fill the buffers with the real rows and inert padded rows, replay verify[n]."""
        n, B = num_reqs_padded, self.bundle
        tok, pos, meta = build_uniform(rows, n, self.cfg.block_size, self.cfg.max_blocks, self.device)
        buf = self.buf
        buf.token_ids[:n * B].copy_(tok)
        buf.positions[:n * B].copy_(pos)
        buf.slot_mapping[:n * B].copy_(meta.slot_mapping)
        buf.seq_lens[:n].copy_(meta.seq_lens)
        buf.block_table[:n].copy_(meta.block_table)
        buf.state_slots[:n].copy_(meta.state_slots)
        buf.num_accepted[:n].copy_(meta.num_accepted)
        self._max_seq_len = meta.max_seq_len
        if self.cuda:
            self.verify_graphs[n].replay()
            out = self.outputs[n]
        else:
            out = self._verify_body(n, meta.max_seq_len)
            self.outputs[n] = out
        return out["hidden"], out["logits"], buf.positions[:n * B]

    @checked
    def propose(self, next_tokens: Int[Tensor, "num_tokens"], last_idx: Int[Tensor, "num_reqs_padded"]
                ) -> Int[Tensor, "num_reqs_padded num_spec"]:
        """Replay propose[n] for the rows filled by the last `verify`."""
        n = last_idx.shape[0]
        self.buf.next_tokens[:next_tokens.shape[0]].copy_(next_tokens)
        self.buf.last_idx[:n].copy_(last_idx)
        if self.cuda:
            self.propose_graphs[n].replay()
            return self.outputs[n]["drafts"]
        return self._propose_body(n, self._max_seq_len, self.outputs[n]["hidden"])["drafts"]

    def describe(self) -> str:
        mode = "CUDA graphs" if self.cuda else "static buffers (CPU replay)"
        return f"{mode}: {self.plan.describe()}"

