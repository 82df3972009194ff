"""mtpkit: speculative decoding with multi-token prediction, shape-typed end to end."""

from .engine.request import RequestOutput, SpecStats
from .errors import CheckpointError, ConfigError, InputError, MtpkitError
from .llm import LLM, StreamEvent
from .shapes import ShapeError, debug, is_debug, set_debug, shape_trace
from .sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "SpecStats", "StreamEvent", "debug",
           "is_debug", "set_debug", "shape_trace", "ShapeError", "ConfigError", "CheckpointError",
           "InputError", "MtpkitError"]
__version__ = "0.1.0"
