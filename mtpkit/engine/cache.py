"""Cache storage and its allocators.

- Paged KV for every full-attention layer (the MTP layer's included): per layer
  k, v [num_blocks, block_size, kv_heads, head_dim]. Block 0 is the null block: padded rows
  read and write it, no request ever owns it.
- GDN state pool for every linear-attention layer: conv [num_slots, conv_dim, conv_state_len]
  (conv_state_len = W - 1 + num_spec, so a verify step can restart at any accepted count) and
  recurrent [num_slots, v_heads, k_dim, v_dim] in fp32 (fp64 when the model runs in fp64).
  Slot 0 is the null slot. A request owns `bundle` slots (the speculative state contract of
  spec_decode.md: read slot a-1, write slot t after token t).
"""

import dataclasses

import torch

from ..config import Qwen3NextConfig
from ..errors import ConfigError
from ..shapes import Float, Tensor


class BlockAllocator:
    """Free list of KV blocks 1..num_blocks-1 (0 is the null block)."""

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ConfigError(f"num_blocks={num_blocks}: need at least 2 (block 0 is the null block)")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n blocks, or None (nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        assert 0 not in blocks, "the null block is never owned"
        self._free.extend(reversed(blocks))


class SlotAllocator:
    """GDN state slots, handed out `per_request` at a time (slot 0 is the null slot)."""

    def __init__(self, num_slots: int, per_request: int):
        self.num_slots, self.per_request = num_slots, per_request
        self.capacity = (num_slots - 1) // per_request  # requests the pool can hold at once
        if self.capacity < 1:
            raise ConfigError(f"num_slots={num_slots} holds no request: each needs {per_request} "
                              "slots plus the null slot")
        self._free = [list(range(1 + i * per_request, 1 + (i + 1) * per_request))
                      for i in range(self.capacity - 1, -1, -1)]

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> list[int] | None:
        return self._free.pop() if self._free else None

    def free(self, slots: list[int]) -> None:
        self._free.append(list(slots))


@dataclasses.dataclass
class CacheTensors:
    """The storage the attention backends read and write; the model never owns a cache."""

    kv: list[tuple[Float[Tensor, "num_blocks block_size kv_heads head_dim"],
                   Float[Tensor, "num_blocks block_size kv_heads head_dim"]]]
    conv: list[Float[Tensor, "num_slots conv_dim conv_state_len"]]
    ssm: list[Float[Tensor, "num_slots v_heads k_dim v_dim"]]
    block_size: int

    @property
    def num_blocks(self) -> int:
        return self.kv[0][0].shape[0] if self.kv else 0

    @property
    def num_slots(self) -> int:
        return self.ssm[0].shape[0] if self.ssm else 0


def kv_bytes_per_block(cfg: Qwen3NextConfig, n_kv_layers: int, block_size: int, dtype, tp_size=1) -> int:
    kv_heads = max(1, cfg.num_key_value_heads // tp_size)
    return 2 * n_kv_layers * block_size * kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8


def state_bytes_per_slot(cfg: Qwen3NextConfig, num_spec: int, dtype, state_dtype, tp_size=1) -> int:
    n = len(cfg.linear_layers)
    conv = cfg.conv_dim // tp_size * (cfg.linear_conv_kernel_dim - 1 + num_spec) * torch.finfo(dtype).bits // 8
    ssm = (cfg.linear_num_value_heads // tp_size) * cfg.linear_key_head_dim * cfg.linear_value_head_dim \
        * torch.finfo(state_dtype).bits // 8
    return n * (conv + ssm)


def allocate_cache(cfg: Qwen3NextConfig, *, num_blocks: int, num_slots: int, block_size: int,
                   num_spec: int, n_kv_layers: int, dtype: torch.dtype, device: torch.device,
                   tp_size: int = 1) -> CacheTensors:
    """Zeroed storage (zeros keep the null block / slot finite)."""
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    kv_heads = max(1, cfg.num_key_value_heads // tp_size)
    kv_shape = (num_blocks, block_size, kv_heads, cfg.head_dim)
    kv = [(torch.zeros(kv_shape, dtype=dtype, device=device),
           torch.zeros(kv_shape, dtype=dtype, device=device)) for _ in range(n_kv_layers)]
    conv_shape = (num_slots, cfg.conv_dim // tp_size, cfg.linear_conv_kernel_dim - 1 + num_spec)
    ssm_shape = (num_slots, cfg.linear_num_value_heads // tp_size, cfg.linear_key_head_dim,
                 cfg.linear_value_head_dim)
    conv = [torch.zeros(conv_shape, dtype=dtype, device=device) for _ in cfg.linear_layers]
    ssm = [torch.zeros(ssm_shape, dtype=state_dtype, device=device) for _ in cfg.linear_layers]
    return CacheTensors(kv=kv, conv=conv, ssm=ssm, block_size=block_size)
