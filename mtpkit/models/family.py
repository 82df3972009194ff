"""The model-family interface, written down: what the engine, the loader and the drafters
call on a family's config class and model class (`FamilyConfig`, `CausalLM`), the base class
every family model inherits (`FamilyModel`: the optional hooks' defaults and the one weight
layout), and the records that declare families and drafter checkpoints (`ModelFamily`,
`DrafterKind`; registered in registry.py).

Everything the engine needs from a family is declared from config.json alone, before any
weight is read: the class-level `cache_spec` and `check_tensor_parallel`. A model is built
as `model_class(cfg, ops, tp, **kw)` (`kw`: what a drafter asks of its target,
DraftSetup.target_kwargs), then filled by the loader (the CheckpointModel part) and run by
the engine (`forward`, `compute_logits`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
from torch import nn

from mtpkit.checkpoint.weights import CheckpointModel
from mtpkit.layers import layout

if TYPE_CHECKING:   # annotations only: the registry imports this module, and `import mtpkit` the registry
    from mtpkit.kernels.ops import Ops
    from mtpkit.shapes import Float, Int, Tensor
    from mtpkit.step.cache import CacheTensors
    from mtpkit.step.cache_spec import CacheSpec
    from mtpkit.step.metadata import PrefillMetadata, UniformMetadata


@runtime_checkable
class FamilyConfig(Protocol):
    """A family's config class: `from_dict` validates a config.json dict (ConfigError naming
    what it does not support); the engine reads these fields of the result."""

    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config") -> FamilyConfig:
        """The validated config of a config.json dict; `where` names the file in errors."""


@runtime_checkable
class CausalLM(CheckpointModel, Protocol):
    """A family's model class (a FamilyModel), as the engine, the graph runner and the draft
    model drafter call it. A family's own drafter (the MTP head, the Gemma 4 assistant) may
    call more of its own target (e.g. `embed`, `kv_sources`): those are the family's, not
    this interface's."""

    ops: Ops

    @staticmethod
    def cache_spec(cfg, *, num_spec: int, tp_size: int = 1) -> CacheSpec:
        """Its cache groups (paged KV, recurrent state), from config.json alone."""

    @staticmethod
    def check_tensor_parallel(cfg, size: int, **kw) -> None:
        """ConfigError naming every dimension `size` ranks cannot split (config.json alone)."""

    def forward(self, token_ids: Int[Tensor, "num_tokens"], positions: Int[Tensor, "num_tokens"],
                meta: PrefillMetadata | UniformMetadata, cache: CacheTensors) -> Float[Tensor, "num_tokens hidden"]:
        """Final hidden states of every token; writes its KV / state through the ops."""

    def compute_logits(self, hidden: Float[Tensor, "num_logits hidden"]) -> Float[Tensor, "num_logits vocab"]:
        """Logits over the whole vocabulary (vocab-parallel: gathered across ranks)."""


class FamilyModel(nn.Module):
    """The base of every family model: the defaults of the loader's optional hooks (so the
    loader and the dummy weights call them, never probe for them) and the weight layout
    every family shares (layers/layout.py)."""

    def checkpoint_aliases(self, shapes: dict[str, tuple[int, ...]]) -> dict:
        """No other layout of its tensors (e.g. Qwen3-Next's fused experts) is read."""
        return {}

    def ignored_checkpoint_prefixes(self) -> tuple[str, ...]:
        """Every checkpoint tensor is read."""
        return ()

    def dummy_value(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """No special start value: the dummy weights' own rules."""
        return None

    def row_major(self, name: str) -> bool:
        """Parameters set_weight_layout leaves row-major: the embedding table, gathered by rows."""
        return name == "embed_tokens"

    def set_weight_layout(self, device: torch.device) -> None:
        """On CPU every matrix that only multiplies is column-major (layers/layout.py)."""
        layout.set_weight_layout(self, device, self.row_major)


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """A model type the engine runs. `default_drafter`: the built-in drafter (a name the
    speculative package builds) `LLM(..., num_spec=k)` uses when no draft_model is given,
    None: speculation needs a draft model (or the checkpoint's own mtpkit.json names one)."""

    model_type: str
    config_class: type
    model_class: type
    default_drafter: str | None = None
    drafter_note: str = ""      # how the default drafter drafts (`mtpkit models`)
    draft_hint: str = ""        # what to pass as draft_model= when there is no default drafter


@dataclasses.dataclass(frozen=True)
class DrafterKind:
    """A checkpoint type that only drafts and cannot run alone (no target family): the
    loader builds its weights as `model_class`, the speculative package's drafter named
    `drafter` runs it. `reads_target_kv`: its layers read the target's KV cache."""

    model_type: str
    config_class: type
    model_class: type
    drafter: str
    what: str                   # what it is, for messages ("a Gemma 4 assistant")
    target: str                 # what it drafts for ("its Gemma 4 target")
    reads_target_kv: bool = True
