"""Errors mtpkit raises at its boundaries. Each message names the problem and the fix."""


class MtpkitError(Exception):
    """Base class of mtpkit's own errors."""


class ConfigError(MtpkitError, ValueError):
    """A configuration that cannot work (raised before any model work)."""


class CheckpointError(MtpkitError, ValueError):
    """A checkpoint with missing, unexpected or misshapen weights, or an unreadable config."""


class InputError(MtpkitError, ValueError):
    """A prompt or sampling parameter that cannot be served (raised before model work)."""
