"""Model families by `model_type`, and model names -> checkpoint directories.

A family is (config class, model class, default drafter). The config class reads a
config.json dict (`from_dict(raw, where)`, raising ConfigError for what it does not
support); the model class is what the engine runs (its interface is in DESIGN.md, "Adding a
model family"); the default drafter names the drafter `LLM(..., num_spec=k)` uses when no
`draft_model` is given (None: speculation needs a draft model). Families register
themselves with `register_family`; `read_config` picks the family from config.json.
"""

import dataclasses
from pathlib import Path

from mtpkit.errors import ConfigError
from mtpkit.checkpoint.hub import ASSETS, checkpoint_default_drafter, read_config_json


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    model_type: str
    config_class: type
    model_class: type
    default_drafter: str | None = None
    draft_hint: str = ""        # what to pass as draft_model= when there is no default drafter


FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> None:
    FAMILIES[family.model_type] = family


def _builtin_families() -> None:
    # Imported here, not at module level: the families import the engine's layers.
    if "qwen3_next" not in FAMILIES:
        from mtpkit.models.qwen3_next.config import Qwen3NextConfig
        from mtpkit.models.qwen3_next.model import Qwen3NextForCausalLM
        register_family(ModelFamily("qwen3_next", Qwen3NextConfig, Qwen3NextForCausalLM, default_drafter="mtp"))
    if "gemma4_text" not in FAMILIES:
        from mtpkit.models.gemma4.config import Gemma4Config
        from mtpkit.models.gemma4.model import Gemma4ForCausalLM
        register_family(ModelFamily("gemma4_text", Gemma4Config, Gemma4ForCausalLM,
                                    draft_hint="the Gemma 4 assistant checkpoint (model_type gemma4_assistant)"))


def supported_model_types() -> list[str]:
    _builtin_families()
    return sorted(FAMILIES)


def family_of(raw: dict, where: str) -> ModelFamily:
    """The family of a config.json dict: its model_type, or (a multimodal wrapper whose own
    type is not a family) its text_config's."""
    _builtin_families()
    mt = raw.get("model_type")
    if mt == "gemma4_assistant":
        raise ConfigError(f"{where}: model_type 'gemma4_assistant' is a Gemma 4 assistant, a drafter that reads its "
                          "target's KV and cannot run alone; pass it as draft_model= with its Gemma 4 target")
    if mt not in FAMILIES and isinstance(raw.get("text_config"), dict):
        mt = raw["text_config"].get("model_type", mt)
    if mt not in FAMILIES:
        raise ConfigError(f"{where}: model_type {raw.get('model_type')!r} is not supported; supported model "
                          f"types: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[mt]


def read_config(path: Path):
    """(family, validated config) of a checkpoint directory, from config.json alone."""
    raw = read_config_json(path)
    where = str(path / "config.json" if path.is_dir() else path)
    family = family_of(raw, where)
    return family, family.config_class.from_dict(raw, where=where)


def describe_builtin(name: str) -> str:
    """One line for `mtpkit models`: the name, its model type and the drafter it uses."""
    path = ASSETS / name
    raw = read_config_json(path)
    mt = raw.get("model_type") or "?"
    drafter = checkpoint_default_drafter(path)
    if mt == "gemma4_assistant":
        use = "a drafter (draft_model=) for its Gemma 4 target"
    elif drafter:
        use = f"drafts with {drafter} by default"
    elif mt == "qwen3_next":
        use = "drafts with its MTP head"
    else:
        use = "no default drafter"
    return f"{name:<24} {mt:<18} {use}"


