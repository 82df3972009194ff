"""Tensor-parallel group: rank, size, how a dimension is split, and the collectives the model
and the engine need. Size 1 is the single-process case and does no communication.

The transport is torch.distributed as `accelerate launch` (or torchrun) sets it up: NCCL on
GPUs, gloo on CPU. Every rank of a group runs the same engine on the same inputs; only weights
differ. A launch may hold several groups (replicas, `replica_ranks`): every collective names
its group, and a rank in it is the group's rank, not the job's.
The collectives take any tensor (plain Tensor): their callers carry the shape types.
"""

import dataclasses
import os

import torch
import torch.distributed as dist

from mtpkit import errors
from mtpkit.errors import ConfigError


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

    @classmethod
    def launched(cls, size: int | None, device: torch.device) -> "TP":
        """The group for `tensor_parallel_size=size` (None: every launched process).

        A job started by a launcher but not yet initialised (WORLD_SIZE > 1 in the environment)
        is initialised here through accelerate, so `LLM(...)` alone works under
        `accelerate launch`. A size below the launched world splits it into world / size
        replicas of consecutive ranks (`replica_ranks`), each its own group: data parallel x
        tensor parallel, where each replica runs its own requests."""
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise ConfigError(f"tensor_parallel_size={size!r} must be an int >= 1")
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
            from accelerate import PartialState
            PartialState(cpu=device.type == "cpu")
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        size = world if size is None else size
        if size != world and world == 1:
            raise ConfigError(
                f"tensor_parallel_size={size} needs {size} processes, and this one runs alone: launch "
                f"the script with `accelerate launch --multi_gpu --num_processes {size} script.py` (on "
                "CPU add --num_machines 1 --mixed_precision no --dynamo_backend no and use "
                "PartialState(cpu=True)), or torchrun --nproc_per_node "
                f"{size}; or pass tensor_parallel_size=1")
        replicas = replica_ranks(world, size)
        if size == 1:
            return cls()
        if size == world:
            return cls.from_environment()
        # new_group is collective over the whole job: every rank creates every replica's group,
        # in the same order, and keeps its own.
        me = dist.get_rank()
        mine = None
        for ranks in replicas:
            group = dist.new_group(ranks)
            if me in ranks:
                mine = cls(rank=ranks.index(me), size=size, group=group)
        return mine

    def rank_device(self, device: torch.device) -> torch.device:
        """A bare "cuda" means this rank's own GPU (LOCAL_RANK, as launchers set it), not GPU 0."""
        if self.size == 1 or device.type != "cuda" or device.index is not None:
            return device
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))

    def split(self, n: int, what: str = "dimension") -> int:
        if n % self.size:
            raise ConfigError(f"{what}={n} is not divisible by the tensor-parallel size {self.size}; "
                              f"use a tensor_parallel_size that divides {n}")
        return n // self.size

    def shard(self, full, dim: int):
        """This rank's equal part of `full` along `dim` (a tensor, or anything with .shape
        and .narrow, such as the loader's not-yet-read checkpoint tensors)."""
        if self.size == 1:
            return full
        part = full.shape[dim] // self.size
        return full.narrow(dim, self.rank * part, part).contiguous()

    def shard_padded(self, full, dim: int) -> torch.Tensor:
        """Part ceil(n / size) of `full` along `dim`, zero-padded at the end of the last
        ranks: lets the vocabulary be split over any number of ranks."""
        if self.size == 1:
            return full
        n = full.shape[dim]
        part = -(-n // self.size)
        start = min(self.rank * part, n)
        length = min(part, n - start)
        pieces = [full.narrow(dim, start, length)] if length else []
        shape = list(full.shape)
        shape[dim] = part - length
        if part > length:
            pieces.append(torch.zeros(shape, dtype=pieces[0].dtype if pieces else torch.float32))
        return torch.cat(pieces, dim=dim)

    # The collectives below take any tensor (activations, logits, sampled tokens, drafts): their
    # callers' boundaries carry the shape names; here no one name fits.
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x concatenated along the last dim (rank order)."""
        if self.size == 1:
            return x
        # Gathered along the first dim (the form every backend takes), then laid side by side.
        out = x.new_empty((self.size * x.shape[0],) + tuple(x.shape[1:]))
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, x.contiguous(), group=self.group)
        return torch.cat(out.chunk(self.size, dim=0), dim=-1)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src` of this group (not of the job) to the others."""
        if self.size > 1:
            dist.broadcast(x, group=self.group, group_src=src)
        return x

    def broadcast_object(self, obj=None, device: torch.device | None = None):
        """Rank 0 of this group's picklable `obj` on every rank (the others pass None and get
        rank 0's). `device`: where the pickled bytes travel (a CUDA device under NCCL; None on
        CPU / gloo)."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self.group, group_src=0,
                                   device=device if device is not None and device.type == "cuda" else None)
        return box[0]

    def raise_if_any_failed(self, error: Exception | None, what: str) -> None:
        """Called by every rank after a phase that can fail on some ranks only (reading weights):
        all learn whether any rank failed, and all raise. Otherwise a failed rank exits while the
        others wait forever in their next collective."""
        if self.size == 1:
            if error is not None:
                raise error
            return
        mine = None if error is None else (type(error).__name__, str(error))
        everyone: list = [None] * self.size
        dist.all_gather_object(everyone, mine, group=self.group)
        if error is not None:
            raise error
        failed = [(r, e) for r, e in enumerate(everyone) if e is not None]
        if failed:
            rank, (name, msg) = failed[0]
            cls = getattr(errors, name, None)
            cls = cls if isinstance(cls, type) and issubclass(cls, errors.MtpkitError) else RuntimeError
            others = f" (and ranks {[r for r, _ in failed[1:]]})" if len(failed) > 1 else ""
            raise cls(f"tensor-parallel rank {rank}{others} failed while {what}, so every rank stops: "
                      f"{name}: {msg}")


def replica_ranks(world: int, size: int) -> list[list[int]]:
    """The launched ranks 0..world-1 as world / size replicas of `size` consecutive ranks
    (consecutive: a launcher numbers a machine's processes together, so a replica's
    all-reduces stay on one machine whenever size divides the processes per machine)."""
    if world % size:
        raise ConfigError(
            f"tensor_parallel_size={size} does not divide the {world} launched processes: each replica "
            f"needs exactly {size} ranks; launch a multiple of {size} processes or use a "
            f"tensor_parallel_size that divides {world}")
    return [list(range(r * size, (r + 1) * size)) for r in range(world // size)]
