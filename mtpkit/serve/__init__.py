"""`mtpkit serve MODEL`: an OpenAI-compatible HTTP server over one LLM (needs the `serve` extra:
`pip install -e ".[serve]"`, FastAPI + uvicorn). app.py: the endpoints; protocol.py: the API's
fields and shapes; metrics.py: /metrics."""

import os

from mtpkit.errors import ConfigError


def check_single_process(tp_size: int = 1) -> None:
    """The server runs in one process: under tensor parallelism every rank would have to receive
    the same requests in the same order, which one HTTP listener cannot give them."""
    world = os.environ.get("WORLD_SIZE", "1")
    if tp_size > 1 or (world.isdigit() and int(world) > 1):
        raise ConfigError("mtpkit serve does not run under tensor parallelism (a launcher's WORLD_SIZE="
                          f"{world}, tensor_parallel_size={tp_size}): every rank would need the same requests in "
                          "the same order; start it as one process (no accelerate launch / torchrun)")


def serve(llm, *, model_name: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          max_body_bytes: int | None = None, log_level: str = "info") -> None:
    """Serve `llm` until interrupted (uvicorn, one worker: the engine is in this process)."""
    import uvicorn

    from mtpkit.serve.app import DEFAULT_MAX_BODY, build_app
    check_single_process(llm.tp.size)
    app = build_app(llm, model_name=model_name, api_key=api_key,
                    max_body_bytes=DEFAULT_MAX_BODY if max_body_bytes is None else max_body_bytes)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
