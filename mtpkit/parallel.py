"""Tensor-parallel group: rank, size, how a dimension is split, and the one collective the
linear family needs. Size 1 is the single-process case and does no communication."""

import dataclasses

import torch
import torch.distributed as dist

from .errors import ConfigError


@dataclasses.dataclass(frozen=True)
class TP:
    rank: int = 0
    size: int = 1
    group: object = None  # torch.distributed process group (None: the default group)

    @classmethod
    def single(cls) -> "TP":
        return cls()

    @classmethod
    def from_environment(cls) -> "TP":
        """The TP group of the launched job (accelerate / torchrun), or a single process."""
        if dist.is_available() and dist.is_initialized():
            return cls(rank=dist.get_rank(), size=dist.get_world_size())
        return cls()

    def split(self, n: int, what: str = "dimension") -> int:
        if n % self.size:
            raise ConfigError(f"{what}={n} is not divisible by the tensor-parallel size {self.size}; "
                              f"use a tensor_parallel_size that divides {n}")
        return n // self.size

    def shard(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        if self.size == 1:
            return full
        part = full.shape[dim] // self.size
        return full.narrow(dim, self.rank * part, part).contiguous()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.size > 1:
            dist.broadcast(x, src=src, group=self.group)
        return x
