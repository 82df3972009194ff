"""`mtpkit serve`'s app (mtpkit/serve/) on a free localhost port: the official `openai` client
gets the engine's own tokens (completions, chat, streaming, seeded sampling, logprobs), bad
input is a 4xx JSON error in OpenAI's shape and the server stays up, and 32 concurrent
streaming clients, one of them disconnecting midway, get the serial run's text while the one
that left is aborted; the pools are whole afterwards."""

import asyncio
import dataclasses
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from mtpkit import LLM, SamplingParams
from mtpkit.serve.app import build_app

KEY = "sk-test"
NAME = "tiny"


@pytest.fixture(scope="module")
def server():
    llm = LLM("tiny-qwen3-next", num_spec=3, max_model_len=512, enforce_eager=True)
    app = build_app(llm, model_name=NAME, api_key=KEY, max_body_bytes=4096)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline and th.is_alive(), "the server did not start"
        time.sleep(0.02)
    yield llm, f"http://127.0.0.1:{port}"
    srv.should_exit = True
    th.join(timeout=10)
    llm.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key=KEY, max_retries=0)


def served(llm, **kw) -> SamplingParams:
    """What the server runs for a request giving `kw`: the checkpoint's generation_config.json
    defaults (the embedded models' frequency penalty) under the request's fields, as vLLM does."""
    return SamplingParams(**{**llm.generation_defaults.sampling, **kw})


def whole(llm) -> bool:
    return (not llm.scheduler.running and not llm.scheduler.waiting and llm.slots.num_free == llm.slots.capacity
            and llm.kv_pools.num_free == llm.kv_pools.capacity)


def test_completions_chat_and_streams_give_the_engine_tokens(server, client):
    llm = server[0]
    greedy, seeded = served(llm, max_tokens=8), served(llm, max_tokens=8, temperature=0.8, seed=11)
    [g], [s] = llm.generate("def f(", greedy), llm.generate("def f(", seeded)
    r = client.completions.create(model=NAME, prompt="def f(", max_tokens=8, temperature=0, logprobs=2)
    assert r.choices[0].text == g.text and r.usage.completion_tokens == 8 and r.usage.prompt_tokens == 6
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == g.text and len(lp.token_logprobs) == 8 and all(len(t) == 2 for t in lp.top_logprobs)
    assert lp.token_logprobs == pytest.approx([d[t].logprob for t, d in zip(g.token_ids, llm.generate(
        "def f(", dataclasses.replace(greedy, logprobs=2))[0].logprobs)], abs=1e-5)
    r = client.completions.create(model=NAME, prompt="def f(", max_tokens=8, temperature=0.8, seed=11)
    assert r.choices[0].text == s.text
    # streaming: the same text, then [DONE] (the client stops there); two prompts: two choices
    chunks = list(client.completions.create(model=NAME, prompt=["def f(", "class A:"], max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in (0, 1)]
    assert texts == [o.text for o in llm.generate(["def f(", "class A:"], greedy)]
    assert chunks[-1].usage.completion_tokens == 16
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"] * 2
    # chat: the embedded template, stop strings, logprobs
    conv = [{"role": "user", "content": "write a stack"}]
    [want] = llm.chat(conv, served(llm, max_tokens=12, stop=["\n"]))
    r = client.chat.completions.create(model=NAME, messages=conv, max_tokens=12, temperature=0, stop="\n",
                                       logprobs=True, top_logprobs=3)
    assert r.choices[0].message.content == want.text and r.choices[0].finish_reason == want.finish_reason
    assert len(r.choices[0].logprobs.content) == len(want.token_ids)
    assert all(len(e.top_logprobs) == 3 for e in r.choices[0].logprobs.content)
    chunks = list(client.chat.completions.create(model=NAME, messages=conv, max_tokens=12, temperature=0, stop="\n",
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert [m.id for m in client.models.list().data] == [NAME]
    assert whole(llm)


def test_n_choices_are_the_engines_samples(server, client):
    """n > 1 (SamplingParams.n): choice i of prompt p is sample i (seed + i), streamed or not;
    greedy n > 1 is a 400 naming the fix."""
    llm = server[0]
    want = llm.generate(["def f(", "class A:"], served(llm, max_tokens=6, temperature=0.9, seed=5, n=3))
    texts = [c.text for o in want for c in o.outputs]
    assert len(set(texts)) > 1   # the samples differ, so a mix-up cannot pass
    r = client.completions.create(model=NAME, prompt=["def f(", "class A:"], max_tokens=6, temperature=0.9, seed=5,
                                  n=3)
    assert [c.index for c in r.choices] == list(range(6)) and [c.text for c in r.choices] == texts
    chunks = list(client.completions.create(model=NAME, prompt=["def f(", "class A:"], max_tokens=6, temperature=0.9,
                                            seed=5, n=3, stream=True))
    assert ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
            for i in range(6)] == texts
    conv = [{"role": "user", "content": "write a stack"}]
    [chat] = llm.chat(conv, served(llm, max_tokens=6, temperature=0.9, seed=5, n=2))
    r = client.chat.completions.create(model=NAME, messages=conv, max_tokens=6, temperature=0.9, seed=5, n=2)
    assert [c.message.content for c in r.choices] == [c.text for c in chat.outputs]
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=NAME, prompt="x", max_tokens=3, temperature=0, n=2)
    assert whole(llm)


def test_structured_outputs_by_response_format_and_vllms_field(server, client):
    """response_format json_schema / json_object (OpenAI) and structured_outputs (vLLM): the
    engine's constrained tokens, valid; a spec that cannot compile is a 400 naming it."""
    import json

    import jsonschema

    from mtpkit import StructuredOutputs
    llm = server[0]
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    conv = [{"role": "user", "content": "a person"}]
    [want] = llm.chat(conv, served(llm, max_tokens=150, structured_outputs=StructuredOutputs(json=schema)))
    r = client.chat.completions.create(model=NAME, messages=conv, max_tokens=150, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}})
    assert r.choices[0].message.content == want.text and r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(want.text), schema)
    [want] = llm.chat(conv, served(llm, max_tokens=20, structured_outputs=StructuredOutputs(json_object=True)))
    r = client.chat.completions.create(model=NAME, messages=conv, max_tokens=20, temperature=0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].message.content == want.text and want.text.startswith("{")
    r = client.completions.create(model=NAME, prompt="answer: ", max_tokens=10, temperature=0,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert r.choices[0].text in ("yes", "no", "maybe")
    with pytest.raises(openai.BadRequestError, match="regex"):
        client.completions.create(model=NAME, prompt="x", max_tokens=5, extra_body={"structured_outputs":
                                                                                   {"regex": "(unclosed"}})
    with pytest.raises(openai.BadRequestError, match="not both"):
        client.chat.completions.create(model=NAME, messages=conv, max_tokens=5, response_format={"type": "json_object"},
                                       extra_body={"structured_outputs": {"choice": ["a"]}})
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(model=NAME, messages=conv, max_tokens=5, response_format={"type": "yaml"})
    assert whole(llm)


def test_bad_requests_are_clear_4xx_errors_and_the_server_stays_up(server):
    llm, base = server
    auth = {"Authorization": f"Bearer {KEY}"}
    cases = [  # (body, headers, status, words the message contains)
        (b"{not json", auth, 400, "not valid JSON"),
        (b"[1, 2]", auth, 400, "JSON object"),
        (b'{"model": "gpt-4", "prompt": "x"}', auth, 404, "does not exist"),
        (b'{"model": "tiny", "prompt": "x", "max_tokens": 100000000}', auth, 400, "exceeds max_model_len"),
        (b'{"model": "tiny", "prompt": "x", "temperature": -1}', auth, 400, "temperature"),
        (b'{"model": "tiny", "prompt": 7}', auth, 400, "prompt must be"),
        (b'{"model": "tiny", "prompt": "x", "stream": true, "stream_options": 3}', auth, 400, "stream_options"),
        (b'{"model": "tiny", "prompt": "x", "stop": 5}', auth, 400, "stop"),
        (b'{"model": "tiny", "prompt": "' + b"x" * 5000 + b'"}', auth, 413, "exceeds the server's limit"),
        (b'{"model": "tiny", "prompt": "x"}', {"Authorization": "Bearer wrong"}, 401, "API key"),
        (b'{"model": "tiny", "prompt": "x"}', {}, 401, "API key"),
    ]
    if "n" not in {f.name for f in dataclasses.fields(SamplingParams)}:   # until SamplingParams has n
        cases.append((b'{"model": "tiny", "prompt": "x", "n": 2}', auth, 400, "n=2 is not supported"))
    with httpx.Client(base_url=base, timeout=30) as h:
        for body, headers, status, words in cases:
            r = h.post("/v1/completions", content=body, headers={**headers, "Content-Type": "application/json"})
            assert r.status_code == status, (body[:60], r.text)
            err = r.json()["error"]
            assert words in err["message"] and err["type"], err
        r = h.post("/v1/chat/completions", json={"model": NAME, "messages": "hi"}, headers=auth)
        assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
        r = h.get("/v1/nowhere", headers=auth)
        assert r.status_code == 404 and r.json()["error"]["message"]
        assert h.get("/health").status_code == 200
        r = h.post("/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 3}, headers=auth)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        metrics = h.get("/metrics").text
        assert 'mtpkit_http_requests_total{endpoint="/v1/completions",status="413"} 1' in metrics
        assert "mtpkit_spec_decode_acceptance_rate" in metrics and "mtpkit_num_requests_waiting 0" in metrics
    assert whole(llm)


def test_32_streaming_clients_one_leaving_midway(server, monkeypatch):
    llm, base = server
    prompts = [f"{w} {i}" for i, w in enumerate(["def", "class", "import", "for"] * 8)]
    want = [o.text for o in llm.generate(prompts, served(llm, max_tokens=8))]
    aborted = []
    real_abort = llm.engine.abort

    def spy(reqs):   # the requests the engine really aborted
        done = real_abort(reqs)
        aborted.extend(done)
        return done
    monkeypatch.setattr(llm.engine, "abort", spy)
    leaver_prompt = "while True:"

    async def main():
        c = openai.AsyncOpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)

        async def one(p):
            stream = await c.completions.create(model=NAME, prompt=p, max_tokens=8, temperature=0, stream=True)
            return "".join([ch.choices[0].text async for ch in stream if ch.choices])

        async def leaver():
            stream = await c.completions.create(model=NAME, prompt=leaver_prompt, max_tokens=480, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
            n = 0
            async for _ in stream:
                n += 1
                if n == 3:
                    break
            await stream.close()   # the connection goes away midway
        results = await asyncio.gather(*(one(p) for p in prompts[:16]), leaver(), *(one(p) for p in prompts[16:]))
        await c.close()
        return results[:16] + results[17:]
    got = asyncio.run(main())
    assert got == want
    deadline = time.monotonic() + 30
    left = llm.tokenizer.encode(leaver_prompt).ids
    while not any(r.prompt_token_ids == left for r in aborted):
        assert time.monotonic() < deadline, "the disconnected client's request was not aborted"
        time.sleep(0.02)
    [r] = [r for r in aborted if r.prompt_token_ids == left]
    assert r.finish_reason == "abort" and len(r.output_token_ids) < 480
    while not whole(llm):
        assert time.monotonic() < deadline, "the pools were not whole again"
        time.sleep(0.02)


def test_serve_refuses_replicas_under_a_launcher(monkeypatch):
    """Under a launcher the server is one tensor-parallel group (rank 0 listens, the others follow:
    tests/test_tp_follow.py); replicas would each need a listener."""
    from mtpkit import ConfigError
    from mtpkit.serve import check_launch
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="tensor_parallel_size=2"):
        check_launch(2)
    check_launch(4)
