"""Drafter set-up from config files: `setup_drafter` picks the drafter of a target and an
optional draft checkpoint, from config.json files alone, before any weight is read.

The choice follows the models' declarations (models/registry.py): a draft checkpoint of a
drafter kind (`DrafterKind`, e.g. Gemma 4's assistant) gets the drafter that kind names; any
other draft checkpoint is a draft model of its own family; without one, the family's
`default_drafter`, else the one the checkpoint names in its mtpkit.json.
"""

from pathlib import Path

from mtpkit.errors import ConfigError
from mtpkit.models.family import ModelFamily
from mtpkit.models.registry import drafter_kind_of, read_config
from mtpkit.checkpoint.hub import checkpoint_default_drafter, read_config_json, resolve_model
from mtpkit.speculative.drafter import DraftSetup


# Each drafter's module is imported when it is chosen (as the families are: registry.py), so
# importing mtpkit does not import every family's layers.
def _mtp():
    from mtpkit.speculative import mtp
    return mtp.setup


def _gemma4_assistant():
    from mtpkit.speculative import gemma4_assistant
    return gemma4_assistant.setup


# The drafters the declarations name: a family's built-in drafter (ModelFamily.default_drafter,
# its weights in the target checkpoint) and a drafter kind's (DrafterKind.drafter).
BUILT_IN_DRAFTERS = {"mtp": _mtp}
KIND_DRAFTERS = {"gemma4_assistant": _gemma4_assistant}


def setup_drafter(family: ModelFamily, cfg, path: Path, *, num_spec: int, draft_model, block_size: int,
                  load_format: str) -> DraftSetup | None:
    if num_spec == 0:
        if draft_model is not None:
            raise ConfigError("draft_model= is given but num_spec=0; pass num_spec >= 1 to draft with it")
        return None
    if draft_model is None and family.default_drafter is None:
        # A checkpoint may name its drafter (the embedded tiny-gemma4: its trained assistant).
        draft_model = checkpoint_default_drafter(path)
    if draft_model is not None:
        draft_path = resolve_model(draft_model)
        raw = read_config_json(draft_path)
        kind = drafter_kind_of(raw)
        if kind is not None:       # a drafter-only checkpoint (it reads the target's KV): its own drafter
            return KIND_DRAFTERS[kind.drafter]()(kind, raw, draft_path, cfg, num_spec, block_size, load_format)
        from mtpkit.speculative import draft_model as dm
        draft_family, draft_cfg = read_config(draft_path)
        return dm.setup(draft_family, draft_cfg, draft_path, cfg, num_spec, block_size)
    if family.default_drafter is not None:
        return BUILT_IN_DRAFTERS[family.default_drafter]()(cfg, path, num_spec, block_size, load_format)
    what = family.draft_hint or "a checkpoint directory or built-in name"
    raise ConfigError(f"num_spec={num_spec} needs a drafter, and model type {family.model_type!r} has no built-in "
                      f"one; pass draft_model= ({what}), or num_spec=0")
