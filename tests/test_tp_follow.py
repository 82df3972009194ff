"""Tensor parallelism led by rank 0 (engine/follow.py): two gloo processes on CPU, rank 0 inside
`llm.lead()` serving two threads of generate and an asyncio call at once, rank 1 in
`llm.follow()`. Their outputs equal a single-process run's, an abort on rank 0 reaches rank 1
(both ranks ran the same steps: their step logs are equal), leaving the block returns both to
the same-calls mode, and rank 0's close ends rank 1's follow. The two ranks are this file run
as a script (so a hang is bounded: the process group's timeout, and the test's). The embedded
tiny-qwen3-next (no checkpoint to build) in float64: TP sums partial products in another order,
and the tokens must not move."""

import asyncio
import datetime
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import oracle
import pytest
import torch

from mtpkit import LLM, SamplingParams
from mtpkit.errors import InputError

MODEL = "tiny-qwen3-next"
F64 = {"dtype": "float64", "device": "cpu", "max_model_len": 128, "max_num_seqs": 6, "enforce_eager": True}
VOCAB = 257
# three calls: thread 0 (greedy), thread 1 (seeded sampling), an asyncio task (greedy, 2 prompts)
LENGTHS = [[5, 17], [9], [1, 12]]
PARAMS = [SamplingParams(max_tokens=10, ignore_eos=True),
          SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.9, seed=11),
          SamplingParams(max_tokens=6, ignore_eos=True)]
LONG = SamplingParams(max_tokens=60, ignore_eos=True)
INTERRUPTED = SamplingParams(max_tokens=90, ignore_eos=True)   # a call Ctrl-C stops midway
SERVED = [("def f(", False), ("class A:", True)]   # (prompt, streamed) sent to rank 0's server


def _calls():
    flat = oracle.random_prompts(5, VOCAB, seed=4, lengths=[n for c in LENGTHS for n in c])
    out, i = [], 0
    for c in LENGTHS:
        out.append(flat[i:i + len(c)])
        i += len(c)
    return out


def _leader(llm: LLM) -> dict:
    calls, results, errors = _calls(), {}, []

    def caller(c):
        try:
            results[c] = [o.token_ids for o in llm.generate(calls[c], PARAMS[c])]
        except BaseException as e:   # noqa: BLE001 - reported in the results
            errors.append(repr(e))
    try:   # outside lead(): every rank must make the same calls, so asyncio is refused (nothing ran)
        asyncio.run(llm.agenerate(calls[2], PARAMS[2]))
        async_refused = None
    except InputError as e:
        async_refused = str(e)
    with llm.lead():
        threads = [threading.Thread(target=caller, args=(c,)) for c in (0, 1)]
        for th in threads:
            th.start()
        results[2] = [o.token_ids for o in asyncio.run(llm.agenerate(calls[2], PARAMS[2]))]
        for th in threads:
            th.join(timeout=60)
        # a refused prompt takes a request id on rank 0 only: the followers must still agree
        bad = llm.generate([[1, 2], [10 ** 6]], SamplingParams(max_tokens=2), errors="return")
        aborted = None
        for ev in llm.stream([3, 4, 5], LONG):
            if len(ev.output.token_ids) >= 3 and aborted is None:
                aborted = llm.abort(ev.output.request_id)
            final = ev.output
        interrupted = _interrupted_call(llm)
        logits = llm.score([7, 8, 9])   # after the interrupt the ranks are still in step
    after = llm.generate(calls[0], PARAMS[0])[0].token_ids   # the same-calls mode again
    return {"results": results, "errors": errors, "bad": [o.error is not None for o in bad], "aborted": aborted,
            "finish": final.finish_reason, "num_tokens": len(final.token_ids), "logits": logits, "after": after,
            "async_refused": async_refused, "interrupted": interrupted}


def _interrupted_call(llm: LLM) -> bool:
    """Ctrl-C in rank 0's main thread while its call runs steps (it lands inside a step or
    between two): the call raises KeyboardInterrupt and its requests are aborted on every rank."""
    import _thread
    import time

    def interrupter():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if any(r.params.max_tokens == INTERRUPTED.max_tokens and len(r.output_token_ids) >= 3
                   for r in list(llm.scheduler.running)):
                _thread.interrupt_main()
                return
            time.sleep(0.002)
    threading.Thread(target=interrupter, daemon=True).start()
    try:
        llm.generate([[6, 7, 8], [9, 10]], INTERRUPTED)
    except KeyboardInterrupt:
        return not llm.scheduler.has_unfinished()
    return False


def _follower(llm: LLM) -> dict:
    refused = []

    def other_thread():   # a call on a following rank from another thread is refused
        while llm.engine.follower_thread is None:
            threading.Event().wait(0.01)
        try:
            llm.generate([1, 2, 3], PARAMS[0])
        except InputError as e:
            refused.append(str(e))
    th = threading.Thread(target=other_thread)
    th.start()
    ended = llm.follow()
    th.join(timeout=30)
    whole = llm.kv_pools.num_free == llm.kv_pools.capacity and llm.slots.num_free == llm.slots.capacity
    after = llm.generate(_calls()[0], PARAMS[0])[0].token_ids
    return {"ended": ended, "whole": whole, "after": after, "refused": refused}


def _http_client(port: int, texts: dict) -> None:
    """Rank 0's HTTP clients: a completion and a streamed one at once; then Ctrl-C to the server."""
    import json
    import signal
    import time
    import urllib.request
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)

    def post(prompt, stream):
        body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                           "stream": stream}).encode()
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            if not stream:
                texts[prompt] = json.load(r)["choices"][0]["text"]
                return
            text = ""
            for line in r:
                line = line.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
            texts[prompt] = text
    try:
        clients = [threading.Thread(target=post, args=p) for p in SERVED]
        for th in clients:
            th.start()
        for th in clients:
            th.join(timeout=60)
    finally:
        os.kill(os.getpid(), signal.SIGINT)   # uvicorn stops; serve() leaves its lead() block


def _rank(rank: int, port: int, http_port: int, root: str) -> None:
    import torch.distributed as dist

    from mtpkit.serve import serve
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=datetime.timedelta(seconds=60))
    llm = LLM(MODEL, num_spec=2, **F64)
    out = _leader(llm) if rank == 0 else _follower(llm)
    # `mtpkit serve`'s serve() on every rank: rank 0 listens, rank 1 follows until it stops
    texts = {}
    if rank == 0:
        threading.Thread(target=_http_client, args=(http_port, texts)).start()
    out["served"] = serve(llm, model_name=MODEL, port=http_port, log_level="warning")
    out["texts"] = texts
    if rank == 0:
        with llm.lead():
            llm.close()
    else:
        out["closed"], out["is_closed"] = llm.follow(), llm.engine.closed
    out["steps"] = [(r.kind, r.request_ids, r.num_tokens) for r in llm.engine.step_log.records()]
    torch.save(out, Path(root) / f"rank{rank}.pt")
    dist.destroy_process_group()


def _rank_dies(rank: int, port: int, root: str) -> None:
    """Rank 0 leads, then its process ends without closing; rank 1 is following."""
    import time

    import torch.distributed as dist

    from mtpkit.engine.follow import RankGone
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=datetime.timedelta(seconds=60))
    llm = LLM(MODEL, num_spec=2, **F64)
    if rank == 0:
        with llm.lead():
            llm.generate([3, 4, 5], PARAMS[0])
            os._exit(3)
    start = time.monotonic()
    try:
        llm.follow()
        out = {"raised": None}
    except RankGone as e:
        out = {"raised": str(e), "after": time.monotonic() - start}
    torch.save(out, Path(root) / "follower.pt")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_follow")   # the ranks' results
    port, http_port, env = _free_port(), _free_port(), {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2"}
    env.pop("LOCAL_RANK", None)
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(port), str(http_port), str(root)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("the two ranks hung (no clean shutdown)")
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    return [torch.load(root / f"rank{r}.pt") for r in range(2)]


def test_rank0_leads_threads_and_asyncio_and_rank1_follows(ranks):
    r0, r1 = ranks
    assert not r0["errors"], r0["errors"]
    ref = LLM(MODEL, num_spec=2, **F64)
    want = {c: [o.token_ids for o in ref.generate(p, PARAMS[c])] for c, p in enumerate(_calls())}
    assert r0["results"] == want
    assert "lead" in r0["async_refused"]
    assert len(r1["refused"]) == 1 and "following rank 0" in r1["refused"][0]
    assert r0["bad"] == [False, True]
    # the abort on rank 0 reached rank 1: it ran exactly rank 0's steps (else its collectives
    # would have met other ones, or it would have run on with the aborted request)
    assert r0["aborted"] and r0["finish"] == "abort" and r0["num_tokens"] < LONG.max_tokens
    assert r0["steps"] == r1["steps"]
    assert r0["interrupted"], "Ctrl-C on rank 0 stops its call (its requests aborted on both ranks)"
    assert any(len(ids) >= 2 for _, ids, _ in r0["steps"]), "the callers' requests shared steps"
    assert r1["ended"] == "end" and r1["whole"], "leaving lead() ends follow(), nothing left running"
    assert r0["after"] == r1["after"] == want[0][0]
    assert r1["closed"] == "close" and r1["is_closed"]
    diff = (r0["logits"] - ref.score([7, 8, 9])).abs().max().item()
    assert diff < 1e-9
    # the server on rank 0 under TP: what the single process generates for those requests
    served = SamplingParams(**{**ref.generation_defaults.sampling, "max_tokens": 8})
    assert r0["texts"] == {p: ref.generate(p, served)[0].text for p, _ in SERVED}
    assert r0["served"] is None and r1["served"] == "end"
    ref.close()


def test_a_follower_whose_leader_dies_raises_at_once(tmp_path):
    port, env = _free_port(), {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2"}
    env.pop("LOCAL_RANK", None)
    procs = [subprocess.Popen([sys.executable, __file__, "die", str(r), str(port), str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        logs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode == 3, logs[0][-2000:]
    out = torch.load(tmp_path / "follower.pt")
    assert out["raised"] and "rank 0, which is gone" in out["raised"], (out, logs[1][-2000:])
    assert out["after"] < 30, out   # not the process group's 60 s timeout


def test_lead_and_follow_refuse_a_single_process():
    with LLM(MODEL, enforce_eager=True) as llm:
        with pytest.raises(InputError, match="follow"):
            llm.follow()
        with llm.lead():   # nothing to lead: a no-op
            assert llm.generate([1, 2], SamplingParams(max_tokens=2))[0].token_ids


if __name__ == "__main__":
    if sys.argv[1] == "die":
        _rank_dies(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        _rank(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
