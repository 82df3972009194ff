"""`mtpkit serve MODEL`: an OpenAI-compatible HTTP server over one LLM (needs the `serve` extra:
`pip install -e ".[serve]"`, FastAPI + uvicorn). app.py: the endpoints; protocol.py: the API's
fields and shapes; metrics.py: /metrics."""

import contextlib
import os
import signal
import threading

from mtpkit.errors import ConfigError


def check_launch(tp_size: int | None = None) -> None:
    """Under a launcher the server runs as one tensor-parallel group: rank 0 listens and the other
    ranks follow its steps (LLM.lead / LLM.follow, engine/follow.py). Several replicas (a
    tensor_parallel_size below the launched world) would each need a listener of their own."""
    world = os.environ.get("WORLD_SIZE", "1")
    world = int(world) if world.isdigit() else 1
    if tp_size is not None and world > 1 and tp_size != world:
        raise ConfigError(f"mtpkit serve runs one tensor-parallel group over every launched process (WORLD_SIZE="
                          f"{world}), not tensor_parallel_size={tp_size}: launch {tp_size} processes, or serve "
                          "each replica from its own launch")


def serve(llm, *, model_name: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          max_body_bytes: int | None = None, log_level: str = "info") -> str | None:
    """Serve `llm` until interrupted (uvicorn, one worker: the engine is in this process). Under
    tensor parallelism call it on every rank: rank 0 listens inside `llm.lead()`, the others
    follow (returning what their `follow()` returned) and leave Ctrl-C, which a launcher sends
    to every rank, to rank 0: its server stops, its lead ends, and so do their follows."""
    check_launch(llm.tp.size)
    if llm.tp.size > 1 and llm.tp.rank != 0:
        with _sigint_ignored():
            return llm.follow()
    import uvicorn

    from mtpkit.serve.app import DEFAULT_MAX_BODY, build_app
    app = build_app(llm, model_name=model_name, api_key=api_key,
                    max_body_bytes=DEFAULT_MAX_BODY if max_body_bytes is None else max_body_bytes)
    with llm.lead():
        try:
            uvicorn.run(app, host=host, port=port, log_level=log_level)
        except KeyboardInterrupt:   # uvicorn shut down on it, then raises it again
            pass
    return None


@contextlib.contextmanager
def _sigint_ignored():
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
