"""Reliability, round two (issue 31): what a new user and a loaded machine found, one test each.

2 pools larger than the machine's memory are a ConfigError before allocation; 3 corrupted weight
data is refused at load, and a non-finite logit row ends only its own request (finish_reason
"error"); 5 `keep_fp8` on a checkpoint without FP8 weights, the only prompt named "prompt"; 6
refused prompts have text "" and unique ids, many bad prompts are listed one per line, capped;
8 the engine seed's range, and torch's thread count given back on close."""

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import mtpkit
from mtpkit import LLM, CheckpointError, ConfigError, InputError, SamplingParams
from mtpkit.checkpoint.hub import resolve_model
from mtpkit.engine import pool_sizing

TINY = resolve_model("tiny-qwen3-next")


def _copy(tmp_path) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(TINY, d)
    return d


def _pools_whole(llm):
    assert llm.kv_pools.num_free == llm.kv_pools.capacity and llm.slots.num_free == llm.slots.capacity


# ---- 2: pools the machine cannot hold ---------------------------------------------------------
def test_default_pools_larger_than_memory_are_refused_before_allocating(monkeypatch):
    import mtpkit.engine.build as build
    monkeypatch.setattr(build, "load_weights", lambda *a, **k: pytest.fail("allocated / loaded"))
    with pytest.raises(ConfigError) as e:
        LLM("tiny-qwen3-next", max_num_seqs=100_000)
    msg = str(e.value)
    assert "GiB" in msg and "available host memory" in msg and "lower max_num_seqs=100000" in msg, msg


def test_the_check_compares_with_what_is_available(monkeypatch):
    llm = LLM("tiny-qwen3-next")
    eng = llm.engine
    sizes = pool_sizing.PoolSizes(kv=dict(llm.kv_pool_sizes), state_slots=llm.slots.capacity + 1)
    need = pool_sizing.pool_bytes(eng.cache_spec, sizes, eng.engine_config.block_size, eng.dtype)
    assert need == sum(t.nbytes for t in eng.cache.tensors())          # what allocate_cache takes
    pool_sizing.check_pools_fit(eng.cache_spec, eng.engine_config, sizes, eng.dtype, eng.device, available=need)
    with pytest.raises(ConfigError, match="more than the"):
        pool_sizing.check_pools_fit(eng.cache_spec, eng.engine_config, sizes, eng.dtype, eng.device,
                                    available=need - 1)


# ---- 3: corrupted weights, non-finite logits --------------------------------------------------
def test_nan_inside_a_tensor_is_refused_at_load(tmp_path):
    d = _copy(tmp_path)
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.1.mlp.experts.2.down_proj.weight"][3, 5] = float("nan")
    tensors["model.norm.weight"][0] = float("inf")
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as e:
        LLM(d)
    msg = str(e.value)
    assert "non-finite" in msg and "model.norm.weight: 1 of 256" in msg and "experts.2.down_proj" in msg, msg


def test_random_bytes_inside_the_data_are_refused_at_load(tmp_path):
    d = _copy(tmp_path)
    f = d / "model.safetensors"
    raw = bytearray(f.read_bytes())
    header = 8 + struct.unpack("<Q", raw[:8])[0]
    info = json.loads(raw[8:header])["model.embed_tokens.weight"]
    start = header + info["data_offsets"][0]
    raw[start + 1000:start + 5000] = os.urandom(4000)            # inside the tensor's data, not its header
    f.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="model.embed_tokens.weight"):
        LLM(d)


@pytest.mark.parametrize("num_spec", [0, 3])
def test_a_non_finite_logit_row_ends_only_its_own_request(num_spec, monkeypatch):
    prompts = ["def fibonacci(n):", "import os\nclass A:"]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    llm = LLM("tiny-qwen3-next", num_spec=num_spec, enforce_eager=True)
    ref = [o.token_ids for o in llm.generate(prompts, params)]     # the same engine, not poisoned yet
    compute, calls = llm.model.compute_logits, [0]

    def poisoned(hidden):
        out = compute(hidden)
        if hidden.shape[0] == 2 * (num_spec + 1):     # a verify step of both requests (not the drafter's)
            calls[0] += 1
        if calls[0] == 2 and hidden.shape[0] == 2 * (num_spec + 1):   # one of them: the first row's NaN
            out = out.clone()
            out[0] = float("nan")
        return out
    monkeypatch.setattr(llm.model, "compute_logits", poisoned)
    outs = llm.generate(prompts, params)
    errored = [o for o in outs if o.finish_reason == "error"]
    assert len(errored) == 1 and "not finite" in errored[0].error and "verify step" in errored[0].error
    fine = [i for i, o in enumerate(outs) if o.finish_reason != "error"]
    assert [outs[i].token_ids for i in fine] == [ref[i] for i in fine] and len(fine) == 1
    _pools_whole(llm)
    assert [o.token_ids for o in llm.generate(prompts, params)] == ref      # the engine goes on


# ---- 5: CLI / facade leftovers --------------------------------------------------------------
def test_keep_fp8_on_a_checkpoint_without_fp8_weights_is_an_error(capsys):
    with pytest.raises(ConfigError, match="has no FP8 weights"):
        LLM("tiny-qwen3-next", keep_fp8=True)
    from mtpkit import cli
    assert cli.main(["generate", "x", "--fp8-weights", "keep"]) == 2
    assert "has no FP8 weights" in capsys.readouterr().err


def test_the_only_prompt_is_named_prompt(capsys):
    llm = LLM("tiny-qwen3-next")
    with pytest.raises(InputError) as e:
        llm.generate([9999])
    assert str(e.value).startswith("prompt: token ids [9999]"), str(e.value)


# ---- 6: errors="return" / "raise" -----------------------------------------------------------
def test_refused_prompts_have_empty_text_and_unique_ids():
    llm = LLM("tiny-qwen3-next")
    outs = llm.generate(["x", [9999], [9998], ""], SamplingParams(max_tokens=3), errors="return")
    assert [o.finish_reason for o in outs] == ["length", "error", "error", "error"]
    assert all(o.text == "" for o in outs[1:]) and outs[1].text[:30] == ""
    assert len({o.request_id for o in outs}) == 4 and all(o.request_id >= 0 for o in outs)


def test_many_bad_prompts_are_listed_one_per_line_capped():
    llm = LLM("tiny-qwen3-next")
    with pytest.raises(InputError) as e:
        llm.generate([[9000 + i] for i in range(29)] + ["fine"])
    lines = str(e.value).splitlines()
    assert lines[0].startswith("29 of 30 prompts are bad; nothing was run")
    assert lines[1].strip().startswith("prompt 0: token ids [9000]") and len(lines) == 1 + 20 + 1
    assert lines[-1].strip() == "... and 9 more" and max(map(len, lines)) < 200
    _pools_whole(llm)


# ---- 8: engine seed, threads ----------------------------------------------------------------
@pytest.mark.parametrize("seed", [-1, 2**70])
def test_engine_seed_range(seed):
    with pytest.raises(ConfigError, match=r"seed=.* must be in 0..2\*\*64-1"):
        LLM("tiny-qwen3-next", seed=seed)


THREADS_SCRIPT = """
import gc, torch
from mtpkit import LLM, InputError, SamplingParams
torch.set_num_threads(2)
llm = LLM("tiny-qwen3-next")                 # a small model: 1 thread while it runs
assert torch.get_num_threads() == 1
llm.close()
assert torch.get_num_threads() == 2
try:
    llm.generate("x")
    raise SystemExit("a closed LLM generated")
except InputError as e:
    assert "closed" in str(e)
with LLM("tiny-qwen3-next") as llm:
    assert torch.get_num_threads() == 1
assert torch.get_num_threads() == 2
llm = LLM("tiny-qwen3-next")
del llm
gc.collect()
assert torch.get_num_threads() == 2
llm = LLM("tiny-qwen3-next")
torch.set_num_threads(3)                     # changed since by the user: left as the user set it
llm.close()
assert torch.get_num_threads() == 3
torch.set_num_threads(2)
# Two engines at once: the count is process-wide, so closing the first keeps the second's
# 1 thread (not the 2 from before the first); closing the last gives the 2 back.
first, second = LLM("tiny-qwen3-next"), LLM("tiny-qwen3-next")
first.close()
assert torch.get_num_threads() == 1
second.generate("x", SamplingParams(max_tokens=2))
assert torch.get_num_threads() == 1
second.close()
assert torch.get_num_threads() == 2
# an engine asking for a count of its own, opened and closed while another holds 1
first = LLM("tiny-qwen3-next")
other = LLM("tiny-qwen3-next", num_threads=2)
assert torch.get_num_threads() == 2
other.close()
assert torch.get_num_threads() == 1
first.close()
assert torch.get_num_threads() == 2
print("ok")
"""


def test_thread_count_given_back_on_close_with_and_collection():
    """In a fresh interpreter: the count is process-wide and held by every open engine, so an
    engine another test left open would change what this one may expect."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", THREADS_SCRIPT], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
    assert mtpkit.LLM is LLM
