"""Tensor parallelism with callers on rank 0 only: rank 0 leads, the other ranks follow.

Without it every rank of a TP group makes the same calls in the same order (the ranks follow
rank 0's sampled tokens, not its schedule). Leading (`LLM.lead()` on rank 0, `LLM.follow()` on
the others), rank 0's engine publishes, under its lock and so in the order it applies them,
every call that changes the schedule or runs the model: a request queued (its prompt ids, its
SamplingParams and its first request id: ids rank 0 gave refused prompts are skipped), an
abort (request ids), a step that has work, a score, and the end (the lead's, or rank 0's
close). A follower applies each as rank 0 did, so its scheduler makes the same plans and its
steps meet rank 0's collectives; everything else (detokenizing, stop strings, grammars) it
rebuilds from the same inputs. Rank 0's callers may then be any number of threads, asyncio
tasks or an HTTP server (engine/loop.py). The transport is the group's own:
torch.distributed broadcast of a pickled op from rank 0 (gloo on CPU, NCCL on GPUs).

A Ctrl-C on rank 0's main thread while it leads is held until the engine call it lands in has
ended (engine._interrupts_held, engine/interrupts.py), so no collective is left half-run. A rank
0 that dies without closing: on gloo its closed connection fails the follower's wait for the
next op at once (measured: ~1 s), and follow() raises RankGone saying so; a transport that does
not notice a lost peer (NCCL may not) leaves the followers waiting until the process group's
timeout, as with any lost rank. Launchers (accelerate launch, torchrun) end the other ranks when
one fails.
"""

import dataclasses
import threading
from collections.abc import Callable

from mtpkit.engine.request import Status
from mtpkit.errors import InputError
from mtpkit.sampling.params import SamplingParams


@dataclasses.dataclass(frozen=True)
class Op:
    """One call rank 0 made, as the followers replay it."""

    kind: str                               # "add", "abort", "step", "score", "end" or "close"
    ids: tuple[int, ...] = ()               # add / score: token ids; abort: request ids
    params: SamplingParams | None = None    # add
    first_id: int | None = None             # add: the request id rank 0 gave it (samples: consecutive)


class RankGone(RuntimeError):
    """The rank this one follows stopped answering (its process ended): the group is broken."""


class Leader:
    """Rank 0's side: publishes each op to the group's other ranks (called under the engine's
    lock, so the ops go out in the order rank 0 applies them)."""

    def __init__(self, tp, device):
        self.tp, self.device = tp, device

    def publish(self, op: Op) -> None:
        self.tp.broadcast_object(op, self.device)


def follow(engine, enqueue: Callable[[list[int], SamplingParams], object]) -> str:
    """Replay rank 0's ops on this rank until the lead ends; returns "end" (rank 0 left its
    `lead()` block: both go on as before, making the same calls) or "close" (rank 0 closed its
    LLM: this one is closed too). `enqueue(ids, params)`: the facade's queueing (its stop
    matcher and grammar for the request), which queues through engine.add."""
    requests: dict[int, object] = {}   # the followed requests by id, every sample (aborts name them)
    engine.follower_thread = threading.get_ident()
    try:
        while True:
            try:
                op: Op = engine.tp.broadcast_object(None, engine.device)
            except RuntimeError as e:   # the transport's own error, e.g. gloo's "Connection closed by peer"
                raise RankGone(f"tensor-parallel rank {engine.tp.rank} follows rank 0, which is gone ({e}). The "
                               "process group is broken: end this process (accelerate launch / torchrun end "
                               "every rank when one fails) and start the group again") from e
            if op.kind == "add":
                engine.resume_ids(op.first_id)
                first = enqueue(list(op.ids), op.params)
                for r in first.samples or [first]:
                    requests[r.req_id] = r
            elif op.kind == "abort":
                engine.abort([requests[i] for i in op.ids if i in requests])
            elif op.kind == "step":
                engine.step()
                if len(requests) > 256:   # forget the finished ones now and then
                    requests = {i: r for i, r in requests.items() if r.status != Status.FINISHED}
            elif op.kind == "score":
                engine.score(list(op.ids))
            elif op.kind == "close":
                engine.follower_thread = None
                engine.close()
                return "close"
            elif op.kind == "end":
                return "end"
            else:
                raise RuntimeError(f"unknown op from rank 0: {op.kind!r} (ranks of different mtpkit versions?)")
    finally:
        engine.follower_thread = None


def check_caller(engine) -> None:
    """A follower's engine takes calls only from the thread that follows (its ops are rank 0's)."""
    ft = engine.follower_thread
    if ft is not None and ft != threading.get_ident():
        raise InputError(f"tensor-parallel rank {engine.tp.rank} is following rank 0 (LLM.follow): its calls are "
                         "rank 0's; make them on rank 0")

