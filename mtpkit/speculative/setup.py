"""Speculative decoding: the drafter interface (drafter.py), its implementations (mtp.py: the
Qwen3-Next MTP head; draft_model.py: a small model of a supported family; gemma4_assistant.py:
Gemma 4's assistant, which reads the target's KV) and lossless verification (rejection.py).

`setup_drafter` picks the drafter from the target's family and an optional draft checkpoint
(its model_type: a `gemma4_assistant` gets its own drafter), else the family's own drafter,
else the one the checkpoint names in its mtpkit.json, from config.json files alone, before
any weight is read.
"""

from pathlib import Path

from mtpkit.errors import ConfigError
from mtpkit.models.registry import ModelFamily, read_config
from mtpkit.checkpoint.hub import checkpoint_default_drafter, read_config_json, resolve_model
from mtpkit.speculative.drafter import DraftSetup


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
        if raw.get("model_type") == "gemma4_assistant":   # reads the target's KV: its own drafter
            from mtpkit.speculative import gemma4_assistant
            return gemma4_assistant.setup(raw, draft_path, cfg, num_spec, block_size, load_format)
        from mtpkit.speculative import draft_model as dm
        draft_family, draft_cfg = read_config(draft_path)
        return dm.setup(draft_family, draft_cfg, draft_path, cfg, num_spec, block_size)
    if family.default_drafter == "mtp":
        from mtpkit.speculative import mtp
        return mtp.setup(cfg, path, num_spec, block_size, load_format)
    what = family.draft_hint or "a checkpoint directory or built-in name"
    raise ConfigError(f"num_spec={num_spec} needs a drafter, and model type {family.model_type!r} has no built-in "
                      f"one; pass draft_model= ({what}), or num_spec=0")
