"""The MTP proposer: num_spec greedy drafts per request from the model's MTP module.

Pass 1 runs the MTP layer over every position of the step that just ran (a prefill chunk or a
verify bundle), with the token AFTER each position and the target's final hidden state there,
so the MTP layer's own KV has an entry for every position of the sequence. Draft 1 is read at
each request's last accepted position. Passes 2..num_spec feed one token per request: the
previous draft and the MTP's own output hidden state, one position further each time.
"""

import torch

from ..attn.metadata import PrefillMetadata, UniformMetadata, UniformRow, build_uniform
from ..config import EngineConfig
from ..engine.cache import CacheTensors
from ..models.qwen3_next import Qwen3NextForCausalLM
from ..shapes import Float, Int, Tensor, checked


class MTPProposer:
    def __init__(self, model: Qwen3NextForCausalLM, ecfg: EngineConfig, device: torch.device):
        self.model, self.cfg, self.device = model, ecfg, device

    @checked
    def propose(
        self,
        hidden: Float[Tensor, "num_tokens hidden"],
        next_tokens: Int[Tensor, "num_tokens"],
        positions: Int[Tensor, "num_tokens"],
        meta: PrefillMetadata | UniformMetadata,
        cache: CacheTensors,
        last_idx: Int[Tensor, "num_reqs"],
        block_ids: list[list[int]],
        num_reqs_padded: int,
    ) -> Int[Tensor, "num_reqs num_spec"]:
        """Drafts for the requests whose last accepted token sits at hidden[last_idx[i]].
        `block_ids[i]` is that request's block table (for the later passes), and
        `num_reqs_padded` the row count those passes are padded to."""
        model, k = self.model, self.cfg.num_spec
        h = model.mtp_forward(next_tokens, positions, hidden, meta, cache, step=0)
        h = h[last_idx]                                               # [num_reqs, hidden]
        draft = model.compute_logits(h).argmax(-1)
        drafts = [draft]
        pos = positions[last_idx].tolist()
        for j in range(1, k):
            rows = [UniformRow([t], p + j, b, [0], 1)
                    for t, p, b in zip(draft.tolist(), pos, block_ids)]
            tok, p_j, meta_j = build_uniform(rows, num_reqs_padded, self.cfg.block_size,
                                             self.cfg.max_blocks, self.device)
            n = len(rows)
            h_in = torch.cat([h, h.new_zeros(num_reqs_padded - n, h.shape[1])])
            h = model.mtp_forward(tok, p_j, h_in, meta_j, cache, step=j)[:n]
            draft = model.compute_logits(h).argmax(-1)
            drafts.append(draft)
        return torch.stack(drafts, dim=1)
