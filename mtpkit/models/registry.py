"""Model names -> checkpoint directories (the embedded models ship in mtpkit/assets)."""

from pathlib import Path

from ..errors import ConfigError

ASSETS = Path(__file__).resolve().parent.parent / "assets"


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
