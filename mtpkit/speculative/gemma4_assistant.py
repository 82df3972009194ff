"""The Gemma 4 assistant drafter: num_spec greedy drafts per request from a separate
`gemma4_assistant` checkpoint whose Q-only layers read the TARGET's KV cache.

One round per request, at the position p of its newest committed token t (KV not written
yet): h is the target's final normed hidden state at the position before (after a prefill
the last prompt position, after a verify step the bundle index of the bonus token: the last
accepted one), and every draft step feeds [E_target[t] * sqrt(Hb); h] with RoPE at the same
p. The keys read are the committed context only: full layers 0..p-1, sliding layers
p-W-1..p-1; the rejected drafts' KV of the verify step (positions >= p) is never read
(transformers reads it for one round after a partial rejection; we do not copy that).

The drafter owns no KV: no cache groups, kv_lookahead 0; kv_read_back 2 (the two keys
before the target's own window at p). Everything is computed on the device from tensors,
so the proposal is captured with the verify step (CUDA graph; CPU trace); a padded row
(position 0, null block table) reads only the null block.
"""

from pathlib import Path

import torch

from mtpkit.kernels.paged import context_slots
from mtpkit.step.cache import CacheTensors
from mtpkit.step.cache_spec import CacheSpec
from mtpkit.errors import CheckpointError, ConfigError
from mtpkit.models.gemma4.model import Gemma4ForCausalLM
from mtpkit.models.gemma4.assistant import Gemma4Assistant, KVRead
from mtpkit.models.gemma4.assistant_config import Gemma4AssistantConfig, compatibility_problems
from mtpkit.models.gemma4.config import Gemma4Config
from mtpkit.checkpoint.loader import checkpoint_index
from mtpkit.models.family import DrafterKind
from mtpkit.shapes import Int, Tensor, checked
from mtpkit.step.draft import DraftInputs, Drafter
from mtpkit.speculative.drafter import DraftSetup, pass_mask

ORDERING = "masked_embedding.token_ordering"


def setup(kind: DrafterKind, raw: dict, path: Path, target_cfg, num_spec: int, block_size: int,
          load_format: str) -> DraftSetup:
    """Every check that the two config.json files decide, in one ConfigError; then
    (`check_checkpoint`) the assistant checkpoint's headers. `kind`: the assistant's
    declaration (models/registry.py), what the loader builds its weights as."""
    where = str(path / "config.json")
    if not isinstance(target_cfg, Gemma4Config):
        raise ConfigError(f"draft model {path} is a Gemma 4 assistant, which drafts only for Gemma 4 targets; the "
                          f"target is model type {getattr(target_cfg, 'model_type', '?')!r}: use a draft model of "
                          "its own family, or its built-in drafter")
    cfg: Gemma4AssistantConfig = kind.config_class.from_dict(raw, where)
    problems = compatibility_problems(cfg, target_cfg)
    if problems:
        raise ConfigError(f"Gemma 4 assistant {path} cannot draft for this target: " + "; ".join(problems)
                          + "; use the assistant trained for this target")

    def check_tensor_parallel(size: int) -> None:
        problems = Gemma4Assistant.tensor_parallel_problems(cfg, size)
        if problems:
            raise ConfigError(f"tensor_parallel_size={size} cannot split the Gemma 4 assistant: " + "; ".join(problems)
                              + "; choose a tensor_parallel_size that divides them")

    def check_checkpoint() -> None:
        if load_format == "safetensors" and cfg.use_ordered_embeddings and ORDERING not in checkpoint_index(path):
            raise ConfigError(f"Gemma 4 assistant {path} sets use_ordered_embeddings but its checkpoint has no "
                              f"{ORDERING} (transformers would silently map every token to 0); use a checkpoint "
                              "that holds it, or set use_ordered_embeddings to false if it was trained without it")

    def build(target: Gemma4ForCausalLM, *, load) -> Drafter:
        # Each layer type reads where the target's source layer of that type keeps its KV.
        assistant = load(kind, cfg, path, kv_at=target.kv_sources())
        _check_ordering(assistant, path)
        return AssistantDrafter(target, assistant, num_spec, block_size)

    # Its round at p reads sliding keys p-W-1..p-1; the target's own window at p starts at
    # p-W+1: two positions more to keep (kv_read_back).
    return DraftSetup(name="gemma4 assistant", num_spec=num_spec, kv_lookahead=0, kv_read_back=2,
                      cache_spec=lambda tp_size: CacheSpec(), check_tensor_parallel=check_tensor_parallel,
                      build=build, check_checkpoint=check_checkpoint, own_dtype=True)


def _check_ordering(assistant: Gemma4Assistant, path: Path) -> None:
    """token_ordering must be a permutation of the vocabulary (transformers initialises it to
    zeros: a checkpoint saved without training it would draft token 0 forever)."""
    m = assistant.masked_embedding
    if m is None or m.token_ordering.device.type == "meta":
        return
    order = m.token_ordering.detach().cpu()
    if not torch.equal(torch.sort(order).values, torch.arange(order.numel())):
        raise CheckpointError(f"{path}: {ORDERING} is not a permutation of 0..{order.numel() - 1} (e.g. transformers' "
                              "untrained zeros); use the checkpoint the assistant was trained with")


class AssistantDrafter(Drafter):
    def __init__(self, target: Gemma4ForCausalLM, assistant: Gemma4Assistant, num_spec: int, block_size: int):
        self.target, self.assistant, self.num_spec, self.block_size = target, assistant, num_spec, block_size
        self.reads = assistant.kv_reads()      # target KV group -> window (None: full)

    def own_modules(self) -> list:
        return [self.assistant]

    def target_block_table(self, inp: DraftInputs, cache: CacheTensors, group: str
                           ) -> Int[Tensor, "num_reqs_padded max_blocks"]:
        """The block table through which the rows read the target's KV group `group` (the
        one place that picks it): that of the pool the group lives in."""
        return inp.block_tables[cache.pool_index[group]]

    def _kv_read(self, inp: DraftInputs, cache: CacheTensors, group: str, window: int | None,
                 p: Int[Tensor, "num_reqs_padded"]) -> KVRead:
        table = self.target_block_table(inp, cache, group)
        ctx = min(inp.max_seq_len, table.shape[1] * self.block_size)     # p <= max_seq_len: keys < p fit
        first = None if window is None else (p - window).clamp(min=0)    # a sliding read: p-W-1 ..
        slots = context_slots(table, p - 1, self.block_size, ctx, first_pos=first)
        return KVRead(seq_lens=p, block_table=table, kv_slots=slots, max_seq_len=ctx)

    @checked
    def propose(self, inp: DraftInputs, cache: CacheTensors) -> Int[Tensor, "num_reqs_padded num_spec"]:
        rows = inp.last_idx
        p = inp.positions[rows] + 1                 # the newest committed token's position: the round's
        token, h = inp.next_tokens[rows], inp.hidden[rows]
        kv = {group: self._kv_read(inp, cache, group, window, p) for group, window in self.reads.items()}
        drafts = []
        for j in range(self.num_spec):
            mask = pass_mask(inp, j, token if j else None)   # structured outputs: the grammar's
            token, h = self.assistant.step(self.target.embed(token), h, p, kv, cache, mask)
            drafts.append(token)
        return torch.stack(drafts, dim=1)
