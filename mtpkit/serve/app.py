"""The OpenAI-compatible HTTP app over one LLM (FastAPI): /v1/completions, /v1/chat/completions
(streaming as server-sent events), /v1/models, /health, /metrics.

Every request is one `LLM.astream` call (engine/loop.py): it runs on a thread of its own and is
batched with every other call in flight, so the event loop never waits for the engine. A bad
request is a 4xx JSON error in OpenAI's shape before anything is queued (the InputError's text
for what LLM refuses). A client that goes away aborts its request: a streaming one when its
response is cancelled (Starlette cancels it on http.disconnect; the stream is closed either
way), a non-streaming one from a task watching for the disconnect.
"""

import asyncio
import collections
import functools
import hmac
import json

from fastapi import FastAPI, Request
from fastapi.responses import (
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from starlette.exceptions import HTTPException as StarletteHTTPException

from mtpkit.errors import InputError
from mtpkit.serve import metrics
from mtpkit.serve.protocol import (
    APIError,
    chat_logprobs,
    chat_messages,
    check_n,
    completion_logprobs,
    completion_prompts,
    new_id,
    now,
    sampling_params,
)

DEFAULT_MAX_BODY = 1 << 20   # bytes of a request body (1 MiB: ~250k tokens of prompt text)


class _EventStream(StreamingResponse):
    """A streaming response whose body iterator is closed however the response ends (sent,
    cancelled on disconnect, a failed send): closing it aborts the request's engine call."""

    def __init__(self, content):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


class _Choice:
    """What one choice (a prompt's sample) has produced so far."""

    def __init__(self):
        self.text, self.tokens, self.logprobs, self.finish_reason, self.prompt_tokens = "", [], [], None, 0
        self.offset = 0   # completions logprobs' text_offset


def build_app(llm, *, model_name: str, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY) -> FastAPI:
    """The app serving `llm` as `model_name`. api_key: required as `Authorization: Bearer KEY`
    on /v1/* (None: open). max_body_bytes: larger request bodies are refused with 413."""
    app = FastAPI(title="mtpkit", docs_url=None, redoc_url=None, openapi_url=None)
    http_counts: collections.Counter = collections.Counter()
    defaults = dict(llm.generation_defaults.sampling)
    max_model_len = llm.engine_config.max_model_len

    def error_response(e: APIError, endpoint: str) -> JSONResponse:
        http_counts[endpoint, e.status] += 1
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        known = request.url.path in {r.path for r in app.routes}   # a scanner's paths are not metric labels
        return error_response(APIError(exc.status_code, str(exc.detail), type="invalid_request_error"),
                              request.url.path if known else "other")

    def endpoint(path: str):
        """A /v1 handler: API key checked, APIError / InputError as OpenAI's JSON error, counted."""
        def wrap(fn):
            @functools.wraps(fn)
            async def handler(request: Request):
                try:
                    if api_key is not None:
                        given = request.headers.get("authorization", "")
                        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                            raise APIError(401, "invalid or missing API key: send `Authorization: Bearer KEY`",
                                           type="authentication_error", code="invalid_api_key")
                    response = await fn(request)
                except APIError as e:
                    return error_response(e, path)
                except InputError as e:
                    return error_response(APIError(400, str(e)), path)
                http_counts[path, response.status_code] += 1
                return response
            return handler
        return wrap

    async def read_json(request: Request) -> dict:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body_bytes:
            raise APIError(413, f"the request body ({length} bytes) exceeds the server's limit of {max_body_bytes} "
                                "bytes (mtpkit serve --max-body-bytes)", code="request_too_large")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body_bytes:
                raise APIError(413, f"the request body exceeds the server's limit of {max_body_bytes} bytes "
                                    "(mtpkit serve --max-body-bytes)", code="request_too_large")
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object")
        model = data.get("model")
        if model is not None and model != model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {model_name!r} "
                                "(GET /v1/models)", param="model", code="model_not_found")
        if not isinstance(data.get("stream", False), bool):
            raise APIError(400, "stream must be true or false", param="stream")
        if not isinstance(data.get("stream_options") or {}, dict):
            raise APIError(400, "stream_options must be an object", param="stream_options")
        return data

    async def until_disconnect(request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def run(request: Request, body: dict, prompts: list, params, chat: bool) -> Response:
        n = check_n(params)
        events = llm.astream(prompts, params)
        try:   # the first event: a refused input raises here, before the response starts
            first = await events.__anext__()
        except StopAsyncIteration:
            first = None
        except InputError as e:
            raise APIError(400, str(e)) from None
        cid, created = new_id("chatcmpl" if chat else "cmpl"), now()
        choices = collections.defaultdict(_Choice)
        top_n = params.logprobs

        def advance(ev) -> tuple[int, _Choice, str, list | None]:
            """Apply one stream event to its choice; (index, choice, its new text, its logprobs object)."""
            i = ev.index * n + getattr(ev, "sample_index", 0)
            c = choices[i]
            if not c.prompt_tokens:   # (reading ev.output builds it: once per choice)
                c.prompt_tokens = len(ev.output.prompt_token_ids)
            c.tokens += ev.new_token_ids
            lps = None
            if ev.new_logprobs is not None:
                c.logprobs += ev.new_logprobs
                lps = (chat_logprobs(llm.tokenizer, ev.new_token_ids, ev.new_logprobs, top_n) if chat else
                       completion_logprobs(llm.tokenizer, ev.new_token_ids, ev.new_logprobs, top_n, c.offset))
                if not chat:
                    c.offset += sum(len(t) for t in lps["tokens"])
            c.text = ev.text
            if ev.finished:
                c.finish_reason = ev.output.finish_reason
            return i, c, ev.delta, lps

        def usage() -> dict:
            prompt = sum(c.prompt_tokens for i, c in choices.items() if i % n == 0)
            completion = sum(len(c.tokens) for c in choices.values())
            return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            obj = "chat.completion.chunk" if chat else "text_completion"

            def chunk(choice: dict | None, **extra) -> str:
                data = {"id": cid, "object": obj, "created": created, "model": model_name,
                        "choices": [] if choice is None else [choice], **extra}
                return f"data: {json.dumps(data)}\n\n"

            async def sse():
                try:
                    if chat:   # the role first, for every choice, as OpenAI sends it
                        for i in range(len(prompts) * n):
                            yield chunk({"index": i, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None})
                    ev = first
                    while ev is not None:
                        i, c, delta, lps = advance(ev)
                        if delta or lps or ev.finished:
                            reason = c.finish_reason if ev.finished else None
                            if chat:
                                yield chunk({"index": i, "delta": {"content": delta} if delta else {},
                                             "logprobs": lps, "finish_reason": reason})
                            else:
                                yield chunk({"index": i, "text": delta, "logprobs": lps, "finish_reason": reason})
                        ev = await anext(events, None)
                    if include_usage:
                        yield chunk(None, usage=usage())
                    yield "data: [DONE]\n\n"
                finally:
                    await events.aclose()
            return _EventStream(sse())

        async def collect():
            try:
                ev = first
                while ev is not None:
                    advance(ev)
                    ev = await anext(events, None)
            finally:
                await events.aclose()

        task, watcher = asyncio.ensure_future(collect()), asyncio.ensure_future(until_disconnect(request))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if not task.done():   # the client went away: abort its request (the cancel waits for the frees)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return Response(status_code=499)
        task.result()
        out = []
        for i in sorted(choices):
            c = choices[i]
            if chat:
                lps = chat_logprobs(llm.tokenizer, c.tokens, c.logprobs, top_n) if top_n is not None else None
                out.append({"index": i, "message": {"role": "assistant", "content": c.text}, "logprobs": lps,
                            "finish_reason": c.finish_reason})
            else:
                lps = completion_logprobs(llm.tokenizer, c.tokens, c.logprobs, top_n, 0) if top_n is not None else None
                out.append({"index": i, "text": c.text, "logprobs": lps, "finish_reason": c.finish_reason})
        return JSONResponse({"id": cid, "object": "chat.completion" if chat else "text_completion", "created": created,
                             "model": model_name, "choices": out, "usage": usage()})

    @app.post("/v1/completions")
    @endpoint("/v1/completions")
    async def completions(request: Request):
        body = await read_json(request)
        params = sampling_params(body, defaults, max_tokens_default=16, chat=False)
        return await run(request, body, completion_prompts(body), params, chat=False)

    @app.post("/v1/chat/completions")
    @endpoint("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_json(request)
        ids = llm.apply_chat_template(chat_messages(body))[0]
        if len(ids) >= max_model_len:
            raise APIError(400, f"the conversation is {len(ids)} tokens: no room for a reply within "
                                f"max_model_len={max_model_len}; shorten it", param="messages")
        params = sampling_params(body, defaults, max_tokens_default=max_model_len - len(ids), chat=True)
        return await run(request, body, [ids], params, chat=True)

    @app.get("/v1/models")
    @endpoint("/v1/models")
    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": 0, "owned_by": "mtpkit",
             "root": str(llm.model_path), "max_model_len": max_model_len}]})

    @app.get("/health")
    async def health():
        return Response(status_code=200 if not llm.engine.closed else 503)

    @app.get("/metrics")
    async def metrics_text():
        return PlainTextResponse(metrics.render(llm, http_counts), media_type="text/plain; version=0.0.4")

    return app
