"""Two threads calling one LLM at once (issue 30's first symptom: wrong tokens or an IndexError
from the runner): the engine runs one call at a time (engine/engine.py `_serialized`), so each
caller gets exactly its own outputs, equal to the serial run, and the pools are whole after."""

import threading

import pytest

from mtpkit import LLM, SamplingParams

PROMPTS = [["def fibonacci(n):", "import os\n"], ["class Stack:", "x = [i for i in"], ["for k in", "while True:"],
           ["try:\n", "return "]]


@pytest.mark.parametrize("num_spec", [0, 3])
def test_threads_get_their_own_outputs_equal_to_the_serial_run(num_spec):
    llm = LLM("tiny-qwen3-next", num_spec=num_spec)
    llm.runner.graphs.trace_after = 0
    params = [SamplingParams(max_tokens=40), SamplingParams(max_tokens=40, temperature=0.8, seed=3)]
    serial = {(t, j): [o.token_ids for o in llm.generate(p, params[j])] for t, p in enumerate(PROMPTS) for j in (0, 1)}
    got, errors = {}, []

    def caller(t):
        try:
            for j in (0, 1):
                got[t, j] = [o.token_ids for o in llm.generate(PROMPTS[t], params[j])]
        except BaseException as e:   # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=caller, args=(t,)) for t in range(len(PROMPTS))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    assert not errors, errors
    assert got == serial
    assert llm.kv_pools.num_free == llm.kv_pools.capacity and llm.slots.num_free == llm.slots.capacity
