"""A classic draft model: a small model of any supported family, run autoregressively with its
own paged KV (allocated in the target's block pool under the prefix "draft.").

After each target step it runs over the step's tokens (its KV for them; the output is not
needed), then drafts one token at a time: the token after each row's last accepted position,
then its own drafts, one position further each. Those passes write num_spec positions past
the target step's last (on the torch backend into a scratch copy of the context instead:
`drafter.scratch_cache`). Families whose models keep recurrent state are refused: rolling a draft
model's state back after a rejection is not implemented.
"""

from pathlib import Path

import torch

from mtpkit.step.cache import CacheTensors
from mtpkit.errors import ConfigError
from mtpkit.shapes import Int, Tensor, checked
from mtpkit.step.draft import DraftInputs, Drafter
from mtpkit.speculative.drafter import (DraftSetup, clamped_slots, draft_argmax, draft_pass_metadata,
                                        proposal_kv_slots, scratch_cache, scratch_pass_metadata, scratch_slots,
                                        uses_scratch)

PREFIX = "draft."


def setup(family, cfg, path: Path, target_cfg, num_spec: int, block_size: int) -> DraftSetup:
    """Checks from the two config.json files alone; the weights load in `build`."""
    problems = []
    if family.model_class.cache_spec(cfg, num_spec=num_spec).has_state:
        problems.append(f"its model type {family.model_type!r} keeps recurrent state, which a draft model "
                        "cannot roll back yet; use a draft model of an attention-only family")
    if cfg.vocab_size != target_cfg.vocab_size:
        problems.append(f"its vocab_size {cfg.vocab_size} differs from the target's {target_cfg.vocab_size}")
    if problems:
        raise ConfigError(f"draft model {path} cannot draft for this target: " + "; ".join(problems))

    def build(target, *, load) -> Drafter:
        return DraftModelDrafter(load(family, cfg, path), num_spec, block_size)

    return DraftSetup(
        name=f"draft model ({family.model_type})", num_spec=num_spec, kv_lookahead=num_spec,
        cache_spec=lambda tp_size: family.model_class.cache_spec(cfg, num_spec=num_spec, tp_size=tp_size)
        .prefixed(PREFIX),
        check_tensor_parallel=lambda size: family.model_class.check_tensor_parallel(cfg, size),
        build=build)


class DraftModelDrafter(Drafter):
    needs_step_metadata = True

    def __init__(self, model, num_spec: int, block_size: int):
        self.model, self.num_spec, self.block_size = model, num_spec, block_size

    def observe(self, inp: DraftInputs, cache: CacheTensors) -> None:
        self.model(inp.token_ids, inp.positions, inp.meta, cache.sub(PREFIX))

    @checked
    def propose(self, inp: DraftInputs, cache: CacheTensors) -> Int[Tensor, "num_reqs_padded num_spec"]:
        own = cache.sub(PREFIX)
        self.model(inp.token_ids, inp.positions, inp.meta, own)
        # Pass j feeds the token at position last + 1 + j: first the target's token after the
        # last accepted one, then the previous draft.
        pos = inp.positions[inp.last_idx] + 1
        kv_slots = proposal_kv_slots(inp.block_tables, pos, self.num_spec, self.block_size, inp.max_seq_len,
                                     cache.pool_windows)
        token, drafts = inp.next_tokens[inp.last_idx], []
        # On the torch backend the passes run against a scratch copy of the context up to the
        # last accepted position (`scratch_cache`), which the step above has written.
        scratch = uses_scratch(self.model.ops)
        if scratch:
            written = clamped_slots(kv_slots, pos - 1)
            pass_cache, slots = scratch_cache(own, written, tuple(own.kv)), scratch_slots(written)
        for j in range(self.num_spec):
            if scratch:
                meta = scratch_pass_metadata(slots, pos + j)
            else:
                meta, pass_cache = draft_pass_metadata(kv_slots, inp.block_tables, pos + j), own
            logits = self.model.compute_logits(self.model(token, pos + j, meta, pass_cache))
            token = draft_argmax(logits, inp, j, token if j else None)
            drafts.append(token)
        return torch.stack(drafts, dim=1)
