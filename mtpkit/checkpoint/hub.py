"""Model names -> checkpoint directories: a directory, an embedded model (mtpkit/assets) or a
Hugging Face hub repo id; a checkpoint's config.json and its own mtpkit.json.
"""

import json
import re
from pathlib import Path

from mtpkit.errors import ConfigError

ASSETS = Path(__file__).resolve().parent.parent / "assets"


def read_config_json(path: Path) -> dict:
    f = path / "config.json" if path.is_dir() else path
    if not f.exists():
        raise ConfigError(f"no config.json at {f}: give a checkpoint directory in Hugging Face layout")
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{f} is not valid JSON: {e}") from None


def builtin_models() -> list[str]:
    return sorted(p.name for p in ASSETS.iterdir() if (p / "config.json").exists()) if ASSETS.exists() else []


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
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )
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
