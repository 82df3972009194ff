"""Model families and drafter checkpoint kinds by `model_type`, and the built-in models'
one-line descriptions.

A family is (config class, model class, default drafter): the config class reads a
config.json dict (`from_dict(raw, where)`, raising ConfigError for what it does not
support); the model class is what the engine runs (the interface: family.py); the default
drafter names the drafter `LLM(..., num_spec=k)` uses when no `draft_model` is given (None:
speculation needs a draft model). A drafter kind is a checkpoint type that only drafts
(Gemma 4's assistant). Both register here (`register_family`, `register_drafter_kind`);
`read_config` picks the family from config.json, `drafter_kind_of` a draft checkpoint's kind.
"""

from pathlib import Path

from mtpkit.errors import ConfigError
from mtpkit.checkpoint.hub import ASSETS, checkpoint_default_drafter, read_config_json
from mtpkit.models.family import DrafterKind, ModelFamily

FAMILIES: dict[str, ModelFamily] = {}
DRAFTER_KINDS: dict[str, DrafterKind] = {}


def register_family(family: ModelFamily) -> None:
    FAMILIES[family.model_type] = family


def register_drafter_kind(kind: DrafterKind) -> None:
    DRAFTER_KINDS[kind.model_type] = kind


def _builtin_families() -> None:
    # Imported here, not at module level: the families import the engine's layers.
    if "qwen3_next" not in FAMILIES:
        from mtpkit.models.qwen3_next.config import Qwen3NextConfig
        from mtpkit.models.qwen3_next.model import Qwen3NextForCausalLM
        register_family(ModelFamily("qwen3_next", Qwen3NextConfig, Qwen3NextForCausalLM, default_drafter="mtp",
                                    drafter_note="drafts with its MTP head"))
    if "gemma4_text" not in FAMILIES:
        from mtpkit.models.gemma4.config import Gemma4Config
        from mtpkit.models.gemma4.model import Gemma4ForCausalLM
        register_family(ModelFamily("gemma4_text", Gemma4Config, Gemma4ForCausalLM,
                                    draft_hint="the Gemma 4 assistant checkpoint (model_type gemma4_assistant)"))
    if "gemma4_assistant" not in DRAFTER_KINDS:
        from mtpkit.models.gemma4.assistant import Gemma4Assistant
        from mtpkit.models.gemma4.assistant_config import Gemma4AssistantConfig
        register_drafter_kind(DrafterKind("gemma4_assistant", Gemma4AssistantConfig, Gemma4Assistant,
                                          drafter="gemma4_assistant", what="a Gemma 4 assistant",
                                          target="its Gemma 4 target"))


def supported_model_types() -> list[str]:
    _builtin_families()
    return sorted(FAMILIES)


def drafter_kind_of(raw: dict) -> DrafterKind | None:
    """The drafter kind a config.json dict declares (its model_type), None for any other."""
    _builtin_families()
    return DRAFTER_KINDS.get(raw.get("model_type"))


def _family_type(raw: dict) -> str | None:
    # Its model_type, or (a multimodal wrapper whose own type is not a family) its text_config's.
    mt = raw.get("model_type")
    if mt not in FAMILIES and isinstance(raw.get("text_config"), dict):
        mt = raw["text_config"].get("model_type", mt)
    return mt


def family_of(raw: dict, where: str) -> ModelFamily:
    """The family of a config.json dict: its model_type, or (a multimodal wrapper whose own
    type is not a family) its text_config's."""
    kind = drafter_kind_of(raw)
    if kind is not None:
        reads = "reads its target's KV and " if kind.reads_target_kv else ""
        raise ConfigError(f"{where}: model_type {kind.model_type!r} is {kind.what}, a drafter that {reads}cannot run "
                          f"alone; pass it as draft_model= with {kind.target}")
    mt = _family_type(raw)
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
    _builtin_families()
    path = ASSETS / name
    raw = read_config_json(path)
    mt = raw.get("model_type") or "?"
    kind, drafter = drafter_kind_of(raw), checkpoint_default_drafter(path)
    family = FAMILIES.get(_family_type(raw))
    if kind is not None:
        use = f"a drafter (draft_model=) for {kind.target}"
    elif drafter:
        use = f"drafts with {drafter} by default"
    elif family is not None and family.default_drafter is not None:
        use = family.drafter_note or f"drafts with its {family.default_drafter} drafter"
    else:
        use = "no default drafter"
    return f"{name:<24} {mt:<18} {use}"


