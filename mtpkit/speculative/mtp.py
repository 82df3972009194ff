"""The MTP proposer: num_spec greedy drafts per request from the model's MTP module.

Pass 1 runs the MTP layer over every position of the step that just ran (a prefill chunk or a
verify bundle), with the token AFTER each position and the target's final hidden state there,
so the MTP layer's own KV has an entry for every position of the sequence; its attention, MoE
and head run only at each request's last accepted position, where draft 1 is read. Passes 2..num_spec feed one token per request: the
previous draft and the MTP's own output hidden state, one position further each time.

Everything is computed on the device from tensors (no host round trip), so the whole proposal
can be captured in a CUDA graph (or traced on CPU, after a verify step or a prefill). The KV
slots all passes attend to are computed once per proposal (`proposal_kv_slots`).
"""

import torch

from ..attn.metadata import UniformMetadata
from ..attn.paged import context_slots
from ..engine.cache import CacheTensors
from ..models.qwen3_next import Qwen3NextForCausalLM
from ..shapes import Float, Int, Tensor, checked


@checked
def proposal_kv_slots(
    block_table: Int[Tensor, "num_reqs_padded max_blocks"],
    pos: Int[Tensor, "num_reqs_padded"],
    num_spec: int,
    block_size: int,
    max_seq_len: int,
) -> Int[Tensor, "num_reqs_padded ctx_len"]:
    """The KV slot of every position the passes of one proposal attend to, computed once for
    all of them: pass j (1-based) queries position pos + j - 1, so the context is
    max_seq_len + num_spec (capped by the block table) and positions past pos + num_spec - 1,
    the last one a pass writes, read that one's slot (storage the request owns: masked)."""
    ctx = min(max_seq_len + num_spec, block_table.shape[1] * block_size)
    return context_slots(block_table, pos + (num_spec - 1), block_size, ctx)


@checked
def draft_pass_metadata(
    kv_slots: Int[Tensor, "num_reqs_padded ctx_len"],
    block_table: Int[Tensor, "num_reqs_padded max_blocks"],
    positions: Int[Tensor, "num_reqs_padded"],
) -> UniformMetadata:
    """Metadata of an MTP pass: one token per row at `positions`, K/V gathered through the
    proposal's `kv_slots` (built on the device). Padded rows sit in the null block."""
    R = positions.shape[0]
    return UniformMetadata(
        seq_lens=positions + 1,
        block_table=block_table,
        slot_mapping=kv_slots.gather(1, positions[:, None])[:, 0],
        state_slots=torch.zeros(R, 1, dtype=torch.int64, device=positions.device),
        num_accepted=torch.ones(R, dtype=torch.int64, device=positions.device),
        num_reqs=R, num_reqs_padded=R, bundle=1,
        max_seq_len=kv_slots.shape[1],
        kv_slots=kv_slots,
    )


@checked
def pass1_inputs(
    token_ids: Int[Tensor, "num_reqs_padded bundle"],
    tokens: Int[Tensor, "num_reqs_padded bundle"],
    num_emitted: Int[Tensor, "num_reqs_padded"],
) -> tuple[Int[Tensor, "num_tokens"], Int[Tensor, "num_reqs_padded"]]:
    """After a verify step that fed `token_ids` ([last token, d_1..d_k] per row) and emitted
    tokens[i, :num_emitted[i]]: the token after each bundle position (what was emitted at
    the accepted positions, the next draft d_{j+1} after them; 0 after the last) and the flat
    index of each row's last accepted position: pass 1's inputs. (Inert padded rows emit one
    token 0 and keep pointing at null storage.)"""
    R, B = token_ids.shape
    after = torch.cat([token_ids[:, 1:], torch.zeros_like(token_ids[:, :1])], dim=1)    # d_{j+1}
    accepted = torch.arange(B, device=tokens.device)[None, :] < num_emitted[:, None]
    nxt = torch.where(accepted, tokens, after)
    last = torch.arange(R, device=tokens.device) * B + num_emitted - 1
    return nxt.reshape(-1), last


class MTPProposer:
    def __init__(self, model: Qwen3NextForCausalLM, num_spec: int, block_size: int):
        self.model, self.num_spec, self.block_size = model, num_spec, block_size

    @checked
    def propose(
        self,
        hidden: Float[Tensor, "num_tokens hidden"],
        next_tokens: Int[Tensor, "num_tokens"],
        positions: Int[Tensor, "num_tokens"],
        slot_mapping: Int[Tensor, "num_tokens"],
        max_seq_len: int,
        cache: CacheTensors,
        last_idx: Int[Tensor, "num_reqs_padded"],
        block_table: Int[Tensor, "num_reqs_padded max_blocks"],
    ) -> Int[Tensor, "num_reqs_padded num_spec"]:
        """Drafts for the rows whose last accepted token sits at hidden[last_idx[i]], after a
        step (prefill or verify) whose tokens sit at `positions` / `slot_mapping` and whose
        longest sequence is at most max_seq_len; `block_table[i]` is that row's block table.
        One token per row and pass after pass 1, so the shapes are fixed by the step's."""
        model, pos = self.model, positions[last_idx]
        kv_slots = proposal_kv_slots(block_table, pos, self.num_spec, self.block_size, max_seq_len)
        # Pass 1 writes the MTP layer's K/V at every position of the step; only each row's
        # last accepted one's output is needed (one query per row, like the later passes).
        first = draft_pass_metadata(kv_slots, block_table, pos)
        h = model.mtp_forward_rows(next_tokens, positions, hidden, slot_mapping, cache, last_idx, first)
        draft = model.compute_logits(h).argmax(-1)
        drafts = [draft]
        # Passes 2..num_spec: the previous draft and pass output, one position further each.
        for j in range(1, self.num_spec):
            meta_j = draft_pass_metadata(kv_slots, block_table, pos + j)
            h = model.mtp_forward(draft, pos + j, h, meta_j, cache, step=j)
            draft = model.compute_logits(h).argmax(-1)
            drafts.append(draft)
        return torch.stack(drafts, dim=1)
