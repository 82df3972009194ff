"""The Qwen3-Next MTP drafter: num_spec greedy drafts per request from the MTP head that
ships inside the target checkpoint (`mtp.*` weights).

Pass 1 runs the MTP layer over every position of the step that just ran (a prefill chunk or a
verify bundle), with the token AFTER each position and the target's final hidden state there,
so the MTP layer's own KV has an entry for every position of the sequence; its attention, MoE
and head run only at each request's last accepted position, where draft 1 is read. Passes 2..num_spec feed one token per request: the
previous draft and the MTP's own output hidden state, one position further each time.

Everything is computed on the device from tensors (no host round trip), so the whole proposal
can be captured in a CUDA graph (or traced on CPU, after a verify step or a prefill). The KV
slots all passes attend to are computed once per proposal (`proposal_kv_slots`); on the torch
backend passes 2..num_spec run against a scratch copy of that context (`scratch_cache`), so
the MTP layer's paged cache is written once per proposal, by pass 1.
"""

from pathlib import Path

import torch

from mtpkit.step.cache import CacheTensors
from mtpkit.errors import ConfigError
from mtpkit.checkpoint.loader import checkpoint_index
from mtpkit.models.qwen3_next.model import MTP_KV_GROUP, Qwen3NextForCausalLM
from mtpkit.models.qwen3_next.config import Qwen3NextConfig
from mtpkit.shapes import Int, Tensor, checked
from mtpkit.step.draft import DraftInputs, Drafter
from mtpkit.speculative.drafter import (DraftSetup, draft_argmax, draft_pass_metadata, proposal_kv_slots,
                                        scratch_cache, scratch_pass_metadata, scratch_slots, uses_scratch)


def has_mtp_weights(path: Path) -> bool:
    return Qwen3NextForCausalLM.holds_mtp_head(checkpoint_index(path))


def setup(cfg: Qwen3NextConfig, path: Path, num_spec: int, block_size: int, load_format: str) -> DraftSetup:
    """The MTP head of the checkpoint at `path` (`check_checkpoint`: from its headers, before
    any weight is read). Its KV group lives beside the target's; passes 2..num_spec write num_spec - 1
    positions past the verify step's last."""
    def check_checkpoint() -> None:
        if load_format == "safetensors" and not has_mtp_weights(path):
            raise ConfigError(f"num_spec={num_spec} needs the checkpoint's mtp.* weights, and {path} has none; "
                              "use num_spec=0, a checkpoint with an MTP head, or draft_model=")

    return DraftSetup(
        name="mtp", num_spec=num_spec, kv_lookahead=num_spec - 1,
        cache_spec=lambda tp_size: Qwen3NextForCausalLM.mtp_cache_spec(cfg, tp_size),
        check_tensor_parallel=lambda size: Qwen3NextForCausalLM.check_tensor_parallel(cfg, size, with_mtp=True),
        build=lambda target, **_: MTPDrafter(target, num_spec, block_size),
        target_kwargs={"with_mtp": True}, check_checkpoint=check_checkpoint, kv_reads_next_token=True,
        own_dtype=True)


class MTPDrafter(Drafter):
    def __init__(self, model: Qwen3NextForCausalLM, num_spec: int, block_size: int):
        self.model, self.num_spec, self.block_size = model, num_spec, block_size

    @checked
    def propose(self, inp: DraftInputs, cache: CacheTensors) -> Int[Tensor, "num_reqs_padded num_spec"]:
        """Drafts for the rows whose last accepted token sits at inp.hidden[inp.last_idx[i]].
        One token per row and pass after pass 1, so the shapes are fixed by the step's."""
        model, pos = self.model, inp.positions[inp.last_idx]
        kv_slots = proposal_kv_slots(inp.block_tables, pos, self.num_spec, self.block_size, inp.max_seq_len,
                                     cache.pool_windows)
        # Pass 1 writes the MTP layer's K/V at every position of the step; only each row's
        # last accepted one's output is needed (one query per row, like the later passes).
        first = draft_pass_metadata(kv_slots, inp.block_tables, pos)
        h = model.mtp_forward_rows(inp.next_tokens, inp.positions, inp.hidden, inp.slot_mappings, cache,
                                   inp.last_idx, first)
        draft = draft_argmax(model.compute_logits(h), inp, 0, None)
        drafts = [draft]
        # Passes 2..num_spec: the previous draft and pass output, one position further each;
        # against a scratch copy of the MTP layer's context when the backend gathers it anyway
        # (not with several MTP layers: a layer other than the first has only these passes'
        # K/V, which later proposals read).
        scratch = self.num_spec > 1 and uses_scratch(model.ops) and len(cache.kv[MTP_KV_GROUP]) == 1
        if scratch:
            pass_cache = scratch_cache(cache, first.kv_slots, (MTP_KV_GROUP,))
            slots = scratch_slots(first.kv_slots)
        for j in range(1, self.num_spec):
            if scratch:
                meta_j = scratch_pass_metadata(slots, pos + j)
            else:
                meta_j, pass_cache = draft_pass_metadata(kv_slots, inp.block_tables, pos + j), cache
            h = model.mtp_forward(draft, pos + j, h, meta_j, pass_cache, step=j)
            draft = draft_argmax(model.compute_logits(h), inp, j, draft)
            drafts.append(draft)
        return torch.stack(drafts, dim=1)

    def own_modules(self) -> list:
        """The MTP module (its embedding and lm_head are the target's: they stay in its dtype)."""
        return [self.model.mtp]

    def observe(self, inp: DraftInputs, cache: CacheTensors) -> None:
        """A prefill chunk that samples nothing: the MTP layer's KV for its positions."""
        self.model.mtp_forward(inp.next_tokens, inp.positions, inp.hidden, inp.meta, cache, step=0)
