"""mtpkit: speculative decoding with multi-token prediction, shape-typed end to end."""

from mtpkit.engine.request import RequestOutput, SpecStats
from mtpkit.errors import CheckpointError, ConfigError, InputError, MtpkitError
from mtpkit.llm import LLM, StreamEvent
from mtpkit.notebook import html as _html  # noqa: F401 - registers the rich displays
from mtpkit.shapes import ShapeError, debug, is_debug, set_debug, shape_trace
from mtpkit.sampling.logprobs import Logprob
from mtpkit.sampling.params import SamplingParams
from mtpkit.sampling.structured_outputs import StructuredOutputs

__all__ = ["LLM", "SamplingParams", "StructuredOutputs", "Logprob", "RequestOutput", "SpecStats", "StreamEvent", "debug",
           "is_debug", "set_debug", "shape_trace", "ShapeError", "ConfigError", "CheckpointError",
           "InputError", "MtpkitError"]
__version__ = "0.1.0"
