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
import re
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


def builtin_models() -> list[str]:
    return sorted(p.name for p in ASSETS.iterdir() if (p / "config.json").exists()) if ASSETS.exists() else []


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


DRAFTER_FILE = "mtpkit.json"   # in a checkpoint directory: {"default_drafter": name or path}


def checkpoint_default_drafter(path: Path) -> str | None:
    """The drafter a checkpoint directory names for itself (mtpkit.json's "default_drafter":
    a built-in name or a directory, relative to the checkpoint's), None when it names none."""
    f = path / DRAFTER_FILE
    if not path.is_dir() or not f.exists():
        return None
    try:
        raw = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{f} is not valid JSON: {e}") from None
    name = raw.get("default_drafter") if isinstance(raw, dict) else None
    if name is None:
        return None
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{f}: default_drafter must be a built-in model name or a directory, got {name!r}")
    return str(path / name) if (path / name).is_dir() else name


# What a checkpoint needs from a hub repo: no training states, other formats' weights
# (*.bin, *.pth, gguf), images or READMEs.
HUB_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
             "*.safetensors", "*.safetensors.index.json"]


def resolve_model(model) -> Path:
    """A checkpoint directory, the name of an embedded model, or a Hugging Face hub repo id
    (downloaded into, or in offline mode (HF_HUB_OFFLINE=1) read from, the HF cache)."""
    path = Path(model)
    if path.is_dir():
        return path
    if isinstance(model, str) and (ASSETS / model).is_dir():
        return ASSETS / model
    if isinstance(model, str) and _looks_like_repo_id(model):
        return hub_snapshot(model)
    raise ConfigError(f"model {str(model)!r} is neither a checkpoint directory nor a built-in model "
                      f"(built-in: {builtin_models() or 'none'}) nor a hub repo id ('org/name')")


def _looks_like_repo_id(name: str) -> bool:
    # A path-like name that does not exist ('./x', '/data/ckpt', 'a/b/c') is a missing
    # directory, not a repo: asking the hub about it would only hide the typo.
    return re.fullmatch(r"[\w.-]+/[\w.-]+", name) is not None and not name.startswith(".")


def hub_snapshot(repo_id: str) -> Path:
    """The local snapshot directory of a hub repo (only the files in HUB_FILES), through
    huggingface_hub: it honours HF_HUB_OFFLINE, HF_HOME / HF_HUB_CACHE and a revision
    already cached."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import (GatedRepoError, HFValidationError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError)
    try:
        folder = huggingface_hub.snapshot_download(repo_id, allow_patterns=HUB_FILES)
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            raise ConfigError(f"model {repo_id!r} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                              "HF_HUB_OFFLINE=1 forbids downloading it: download it once with network access "
                              f"(`hf download {repo_id}`), point HF_HOME / HF_HUB_CACHE at a cache that holds "
                              "it, or pass a checkpoint directory") from None
        raise ConfigError(f"model {repo_id!r} could not be downloaded from the Hugging Face hub and is not in the "
                          f"cache ({constants.HF_HUB_CACHE}): check the network, or pass a checkpoint "
                          "directory") from None
    except (RepositoryNotFoundError, GatedRepoError, HFValidationError) as e:
        raise ConfigError(f"model {repo_id!r}: the Hugging Face hub refused it ({type(e).__name__}: "
                          f"{str(e).splitlines()[0]}); check the name, or log in (`hf auth login`) for a "
                          "gated or private repo") from None
    return Path(folder)
