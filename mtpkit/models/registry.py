"""Model families by `model_type`, and model names -> checkpoint directories.

A family is (config class, model class, default drafter). The config class reads a
config.json dict (`from_dict(raw, where)`, raising ConfigError for what it does not
support); the model class is what the engine runs (its interface is in DESIGN.md, "Adding a
model family"); the default drafter names the drafter `LLM(..., num_spec=k)` uses when no
`draft_model` is given (None: speculation needs a draft model). Families register
themselves with `register_family`; `read_config` picks the family from config.json.
"""

import dataclasses
import json
from pathlib import Path

from ..errors import ConfigError

ASSETS = Path(__file__).resolve().parent.parent / "assets"


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
        from .qwen3_next import Qwen3NextForCausalLM
        from .qwen3_next_config import Qwen3NextConfig
        register_family(ModelFamily("qwen3_next", Qwen3NextConfig, Qwen3NextForCausalLM, default_drafter="mtp"))
    if "gemma4_text" not in FAMILIES:
        from .gemma4 import Gemma4ForCausalLM
        from .gemma4_config import Gemma4Config
        register_family(ModelFamily("gemma4_text", Gemma4Config, Gemma4ForCausalLM,
                                    draft_hint="the Gemma 4 assistant checkpoint (model_type gemma4_assistant)"))


def supported_model_types() -> list[str]:
    _builtin_families()
    return sorted(FAMILIES)


def read_config_json(path: Path) -> dict:
    f = path / "config.json" if path.is_dir() else path
    if not f.exists():
        raise ConfigError(f"no config.json at {f}: give a checkpoint directory in Hugging Face layout")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{f} is not valid JSON: {e}") from None


def family_of(raw: dict, where: str) -> ModelFamily:
    """The family of a config.json dict: its model_type, or (a multimodal wrapper whose own
    type is not a family) its text_config's."""
    _builtin_families()
    mt = raw.get("model_type")
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


def builtin_models() -> list[str]:
    return sorted(p.name for p in ASSETS.iterdir() if (p / "config.json").exists()) if ASSETS.exists() else []


def resolve_model(model) -> Path:
    """A checkpoint directory, or the name of an embedded model."""
    path = Path(model)
    if path.is_dir():
        return path
    if isinstance(model, str) and (ASSETS / model).is_dir():
        return ASSETS / model
    raise ConfigError(f"model {str(model)!r} is neither a checkpoint directory nor a built-in model "
                      f"(built-in: {builtin_models() or 'none'})")
