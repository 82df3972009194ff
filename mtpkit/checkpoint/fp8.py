"""Fine-grained FP8 checkpoints (Qwen3-Next-80B-A3B-Instruct-FP8, DeepSeek-V3 style), read as
transformers 5.24's finegrained-FP8 integration reads them.

config.json `quantization_config`: quant_method "fp8", weight_block_size [bn, bk] (null: one
scale per tensor), activation_scheme "dynamic", modules_to_not_convert (alias
ignored_layers: kept in the model dtype in the file), scale_fmt "float" or "ue8m0". A
quantized linear stores `<m>.weight` float8_e4m3fn [N, K] and `<m>.weight_scale_inv`
[ceil(N/bn), ceil(K/bk)] (leading dims for fused experts). The loader presents each such pair
as one tensor that dequantizes when read (`Dequantized`), so every module's checkpoint specs,
shape checks and tensor-parallel slicing work unchanged; a linear layer in FP8 mode reads the
raw pair instead (layers.Linear.use_fp8).
"""

import dataclasses

import torch

from mtpkit.kernels.fp8_matmul import dequantize
from mtpkit.errors import CheckpointError, ConfigError
from mtpkit.checkpoint.weights import read


@dataclasses.dataclass(frozen=True)
class FP8Format:
    block: tuple[int, int] | None          # [bn, bk]; None: one scale per tensor
    not_converted: tuple[str, ...] = ()    # module names kept unquantized

    @staticmethod
    def from_config(raw: dict, where: str) -> "FP8Format | None":
        """The checkpoint's FP8 format, None when it is not quantized; anything else that is
        quantized is refused here, before any weight is read."""
        q = raw.get("quantization_config")
        if q is None and isinstance(raw.get("text_config"), dict):
            q = raw["text_config"].get("quantization_config")
        if q is None:
            return None
        method = q.get("quant_method")
        if method != "fp8":
            raise ConfigError(f"{where}: quantization_config.quant_method={method!r} is not supported; mtpkit "
                              "reads fine-grained FP8 checkpoints (quant_method 'fp8') and unquantized ones")
        scheme = q.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ConfigError(f"{where}: quantization_config.activation_scheme={scheme!r} is not supported; "
                              "mtpkit quantizes activations dynamically (activation_scheme 'dynamic')")
        block = q.get("weight_block_size")
        if block is not None:
            if (not isinstance(block, (list, tuple)) or len(block) != 2
                    or not all(isinstance(b, int) and b > 0 for b in block)):
                raise ConfigError(f"{where}: quantization_config.weight_block_size={block!r} must be two "
                                  "positive ints, e.g. [128, 128], or null")
            block = (block[0], block[1])
        skip = q.get("modules_to_not_convert") or q.get("ignored_layers") or ()
        return FP8Format(block, tuple(skip))

    def scale_name(self, weight_name: str) -> str:
        return weight_name + "_scale_inv"

    def scale_shape(self, weight_shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.block is None:
            return ()
        *lead, n, k = weight_shape
        return (*lead, -(-n // self.block[0]), -(-k // self.block[1]))


class Dequantized:
    """An FP8 checkpoint tensor and its scales, not read yet: reads as the dequantized tensor
    (fp32, the loader casts it to the model dtype). Shaped like the weight."""

    def __init__(self, weight, scale, block: tuple[int, int] | None):
        self.weight, self.scale, self.block = weight, scale, block
        self.shape = weight.shape

    def read(self) -> torch.Tensor:
        return dequantize(read(self.weight), read(self.scale), self.block, torch.float32)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        # A tensor-parallel slice: dequantize the whole tensor, then cut (one tensor at a time).
        return self.read().narrow(dim, start, length)


def pair_scales(fmt: FP8Format, shapes: dict[str, tuple[int, ...]], dtypes: dict[str, str],
                where: str) -> dict[str, str]:
    """weight name -> its scale name for every FP8 tensor of the checkpoint (`dtypes`: the
    safetensors header's dtype names), after checking that each has a scale of the right
    shape and each scale an FP8 weight (one CheckpointError listing every problem)."""
    pairs, problems = {}, []
    for name, dt in dtypes.items():
        if dt != FP8_HEADER:
            continue
        s = fmt.scale_name(name)
        want = fmt.scale_shape(tuple(shapes[name]))
        if s not in shapes:
            problems.append(f"  {name} is float8_e4m3fn but {s} is missing")
        elif tuple(shapes[s]) not in (want, (1,) if want == () else want):
            problems.append(f"  {s} has shape {list(shapes[s])}, expected {list(want)} for {name} "
                            f"{list(shapes[name])} with weight_block_size {list(fmt.block or [])}")
        else:
            pairs[name] = s
    scales = set(pairs.values())
    for name in shapes:
        if name.endswith("_scale_inv") and name not in scales:
            weight = name[:-len("_scale_inv")]
            if dtypes.get(weight) != FP8_HEADER:
                problems.append(f"  {name} has no float8_e4m3fn weight {weight} "
                                f"({'absent' if weight not in dtypes else dtypes[weight]})")
    if problems:
        raise CheckpointError(f"FP8 checkpoint {where} is inconsistent (quantization_config says fp8):\n"
                              + "\n".join(problems))
    return pairs


FP8_HEADER = "F8_E4M3"  # float8_e4m3fn in a safetensors header
