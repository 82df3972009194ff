"""Engine settings and dtype resolution. Model configurations belong to their families
(mtpkit/models/); `models.registry.read_config` reads config.json for any of them."""

import dataclasses

import torch

from mtpkit.errors import ConfigError

# Drafts per verify step: LLM(num_spec=) and the graph capture plan share this bound.
MAX_NUM_SPEC = 8

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float64": torch.float64, "fp64": torch.float64,
          "float16": torch.float16, "fp16": torch.float16}


SUPPORTED_DEVICES = "'cpu', 'cuda' or 'cuda:N' (a torch.device of those types works too)"


def resolve_device(device) -> torch.device:
    """`device`: None (CUDA when available, else CPU), a name or a torch.device of type cpu or
    cuda. Anything else, or CUDA where torch sees no GPU, is a ConfigError saying what works."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, (str, torch.device)):
        raise ConfigError(f"device={device!r} must be a str or torch.device: {SUPPORTED_DEVICES}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise ConfigError(f"device={str(device)!r} is not a device torch knows; use {SUPPORTED_DEVICES}") from e
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device={str(device)!r} is not supported by mtpkit; use {SUPPORTED_DEVICES}")
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            why = "this torch build has no CUDA support" if torch.version.cuda is None else "torch sees no GPU"
            raise ConfigError(f"device={str(device)!r}: there is no CUDA device ({why}); use device='cpu' "
                              "(or device=None, which picks CUDA only when a GPU is present)")
        if dev.index is not None and dev.index >= n:
            raise ConfigError(f"device={str(device)!r}: only {n} CUDA device(s) (cuda:0..cuda:{n - 1})")
    return dev


def resolve_dtype(dtype, device: torch.device, cfg_dtype: str | None = None) -> torch.dtype:
    """`dtype` may be a torch.dtype, a name, or "auto": float32 on CPU (small-batch CPU steps
    are overhead-bound, and bf16 adds conversions), the checkpoint's dtype on CUDA."""
    if dtype is None or dtype == "auto":
        dtype = cfg_dtype if device.type == "cuda" and cfg_dtype in DTYPES else "float32"
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ConfigError(f"dtype {dtype!r} is not supported; use one of float32, bfloat16, float64")
        dtype = DTYPES[dtype]
    if dtype not in (torch.float32, torch.bfloat16, torch.float64, torch.float16):
        raise ConfigError(f"dtype {dtype} is not supported; use float32, bfloat16 or float64")
    if device.type == "cpu" and dtype == torch.float16:
        raise ConfigError("float16 has no fast path on CPU (about 100x slower); use bfloat16 or float32")
    if device.type == "cuda" and dtype == torch.float64:
        raise ConfigError("float64 is for CPU exactness tests; use bfloat16 or float32 on CUDA")
    return dtype


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine, speculation and graph settings (validated by mtpkit.llm before model work)."""

    num_spec: int = 0
    kv_lookahead: int = 0                # KV positions the drafter writes past the target step's last
    kv_read_back: int = 0                # positions before a sliding window the drafter reads
    max_num_seqs: int = 8
    max_model_len: int = 2048
    block_size: int = 16
    max_num_batched_tokens: int = 2048   # token budget of a prefill step
    num_scheduler_steps: int = 1         # decode steps per scheduling (EngineArgs; CPU graphs, num_spec 0)

    @property
    def bundle(self) -> int:
        return self.num_spec + 1

    @property
    def max_positions(self) -> int:
        # A verify step of a request at its last decodable position writes num_spec positions
        # past the sequence, and its drafter kv_lookahead more.
        return self.max_model_len + self.num_spec + self.kv_lookahead

    @property
    def verify_span(self) -> int:
        """Positions a verify step writes from num_computed on: the bundle, then the drafter's
        lookahead."""
        return self.bundle + self.kv_lookahead

    @property
    def decode_span(self) -> int:
        """Positions a verify step writes from num_computed on, decode steps run in a row
        (num_scheduler_steps) included: what a steady-state step holds blocks for."""
        return self.verify_span + self.num_scheduler_steps - 1

    @property
    def max_blocks(self) -> int:
        return -(-self.max_positions // self.block_size)
