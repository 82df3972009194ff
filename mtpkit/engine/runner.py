"""Runs one scheduled step: metadata -> model -> sampler / rejection -> proposer.

Prefill steps run eager. Verify steps (and the MTP proposal after them) go through the graph
runner (mtpkit.graphs: static buffers, captured replays) unless enforce_eager; padded rows are
inert by construction.

Under tensor parallelism every rank runs this same code on the same inputs. The sampled tokens,
accepted counts and drafts decide the next step's inputs on every rank (and so what the model's
collectives combine), so rank 0's are broadcast: identical decisions do not rest on every rank's logits being
bit-identical or on every rank's argmax breaking ties alike.
"""

import torch

from ..attn.metadata import PrefillChunk, UniformRow, build_prefill, build_uniform
from ..config import EngineConfig
from ..models.qwen3_next import Qwen3NextForCausalLM
from ..graphs.plan import CapturePlan
from ..graphs.runner import GraphRunner
from ..speculative.mtp import MTPProposer, pass1_inputs
from ..speculative.rejection import rejection_sample
from ..sampling import SamplingParams, SamplingTensors
from .cache import CacheTensors
from .scheduler import ReqResult, StepKind, StepPlan


class ModelRunner:
    def __init__(self, model: Qwen3NextForCausalLM, cache: CacheTensors, ecfg: EngineConfig,
                 device: torch.device, plan: CapturePlan | None = None):
        """`plan` None: every step eager. Otherwise verify steps run through the graph runner."""
        self.model, self.cache, self.cfg, self.device = model, cache, ecfg, device
        self.tp = model.tp
        self.proposer = MTPProposer(model, ecfg.num_spec, ecfg.block_size) if ecfg.num_spec > 0 else None
        self._all_greedy: dict[int, SamplingTensors] = {}
        self.graphs = None
        if plan is not None:
            self.graphs = GraphRunner(model, cache, ecfg, plan, self.proposer, device)
            self.graphs.capture()

    def _sampling(self, params: list[SamplingParams]) -> SamplingTensors:
        """The step's sampling tensors. An all-greedy batch's depend only on its size (top-k
        and top-p do not apply to greedy rows): built once per size and reused (1.4 us
        instead of ~18 per step; nothing writes to them)."""
        if any(p.temperature != 0 for p in params):
            return SamplingTensors.from_params(params, self.device)
        n = len(params)
        if n not in self._all_greedy:
            self._all_greedy[n] = SamplingTensors.from_params([SamplingParams()] * n, self.device)
        return self._all_greedy[n]

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> list[ReqResult]:
        if plan.kind == StepKind.PREFILL:
            return self._prefill(plan)
        return self._verify(plan)

    # ---- prefill ----------------------------------------------------------------------
    def prefill_hidden(self, chunks: list[PrefillChunk]):
        token_ids, positions, meta = build_prefill(chunks, self.cfg.block_size, self.cfg.max_blocks, self.device)
        return self.model(token_ids, positions, meta, self.cache), positions, meta

    def _prefill(self, plan: StepPlan) -> list[ReqResult]:
        reqs = plan.reqs
        chunks = [PrefillChunk(r.all_token_ids[r.num_computed:r.num_computed + n], r.num_computed,
                               r.block_ids, r.state_slots[0], r.state_slots[-1])
                  for r, n in zip(reqs, plan.chunk_lens)]
        hidden, positions, meta = self.prefill_hidden(chunks)
        done = [i for i, (r, n) in enumerate(zip(reqs, plan.chunk_lens)) if r.num_computed + n == r.prefill_target]
        results = [ReqResult([], 1, 0, []) for _ in reqs]
        if not done:
            sampled = []
        else:
            last = meta.logits_indices[done]
            logits = self.model.compute_logits(hidden[last])[:, None, :]            # [done, 1, vocab]
            sub = [reqs[i] for i in done]
            st = self._sampling([r.params for r in sub])
            empty = torch.zeros(len(done), 0, dtype=torch.int64, device=self.device)
            tokens, _ = rejection_sample(logits, empty, torch.zeros(len(done), dtype=torch.int64,
                                                                    device=self.device),
                                         st, [r.seed for r in sub], [r.prefill_target for r in sub])
            sampled = self.tp.broadcast(tokens[:, 0].contiguous()).tolist()
            for i, t in zip(done, sampled):
                results[i].emitted = [t]
        if self.proposer is not None:
            # The token after each position: the next prompt token, or for a finished prompt
            # the token just sampled (a non-final chunk's last position sees the next chunk's first).
            nxt = []
            sampled_of = dict(zip(done, sampled))
            for i, (r, n) in enumerate(zip(reqs, plan.chunk_lens)):
                seq = r.all_token_ids
                follow = seq[r.num_computed + 1:r.num_computed + n]
                follow.append(sampled_of[i] if i in sampled_of else seq[r.num_computed + n])
                nxt.extend(follow)
            next_tokens = torch.tensor(nxt, dtype=torch.int64, device=self.device)
            if done:
                last = meta.logits_indices[done]
                drafts = self._prefill_drafts(hidden, next_tokens, positions, meta, last, meta.block_table[done])
                drafts = self.tp.broadcast(drafts.contiguous())
                for i, d in zip(done, drafts.tolist()):
                    results[i].drafts = d
            else:  # fill the MTP layer's KV for these positions; no drafts yet
                self.model.mtp_forward(next_tokens, positions, hidden, meta, self.cache, step=0)
        return results

    def _prefill_drafts(self, hidden, next_tokens, positions, meta, last, block_table):
        """The MTP proposal after a prefill: through the graph runner when there is one."""
        if self.graphs is None:
            return self.proposer.propose(hidden, next_tokens, positions, meta.slot_mapping, meta.max_seq_len,
                                         self.cache, last, block_table)
        return self.graphs.prefill_proposal(hidden, next_tokens, positions, meta.slot_mapping, meta.max_seq_len,
                                            last, block_table)

    # ---- verify -----------------------------------------------------------------------
    def _verify(self, plan: StepPlan) -> list[ReqResult]:
        reqs, R, B, k = plan.reqs, plan.num_reqs, plan.bundle, plan.bundle - 1
        n = plan.num_reqs_padded
        rows = [UniformRow([r.all_token_ids[-1]] + r.drafts, r.num_computed, r.block_ids,
                           r.state_slots, r.num_accepted) for r in reqs]
        if self.graphs is not None:
            hidden, logits, positions, token_ids = self.graphs.verify(rows, n)
        else:
            token_ids, positions, meta = build_uniform(rows, n, self.cfg.block_size, self.cfg.max_blocks,
                                                       self.device)
            hidden = self.model(token_ids, positions, meta, self.cache)
            logits = self.model.compute_logits(hidden)
        logits = logits.view(n, B, -1)[:R]
        drafts = token_ids.view(n, B)[:R, 1:]                                 # [R, k]: d_1..d_k
        limit_list = [min(k, max(r.remaining(self.cfg.max_model_len) - 1, 0)) for r in reqs]
        limit = torch.tensor(limit_list, dtype=torch.int64, device=self.device)
        st = self._sampling([r.params for r in reqs])
        # Bundle index j samples the token at position num_computed + 1 + j.
        tokens, n_emit = rejection_sample(logits, drafts, limit, st, [r.seed for r in reqs],
                                          [r.num_computed + 1 for r in reqs])
        if self.tp.size > 1:  # one broadcast for both
            both = self.tp.broadcast(torch.cat([tokens, n_emit[:, None]], dim=1))
            tokens, n_emit = both[:, :B], both[:, B]
        n_list, tok_list = n_emit.tolist(), tokens.tolist()
        new_drafts = [[] for _ in reqs]
        if self.proposer is not None:
            if self.graphs is not None:
                drafts_out = self.graphs.propose(tokens, n_emit)
            else:  # eager: n == R
                next_tokens, last = pass1_inputs(token_ids.view(n, B), tokens, n_emit)
                drafts_out = self.proposer.propose(hidden, next_tokens, positions, meta.slot_mapping,
                                                   meta.max_seq_len, self.cache, last, meta.block_table)
            new_drafts = self.tp.broadcast(drafts_out[:R].contiguous()).tolist()
        return [ReqResult(tok_list[i][:n_list[i]], n_list[i], limit_list[i], new_drafts[i]) for i in range(R)]
