"""Tensor parallelism on CPU: two gloo processes against one process.

Every two-process case runs in ONE `accelerate.debug_launcher` job (module fixture `tp2`), which
writes each rank's results to a file; the tests below check them against single-process runs
made here. float64 throughout: TP sums partial products in another order (rounding-level logit
differences), and greedy tokens must still be identical. serve_batch.py runs under the real
`accelerate launch` command and as plain `python`.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import oracle
import spec_models
from mtpkit import LLM, ConfigError, SamplingParams
from mtpkit.layers.linear import KVParallelLinear
from mtpkit.parallel import TP

# accelerate's launchers meet on a fixed port: this file takes turns with the others that start them (conftest)
pytestmark = pytest.mark.fixed_port

ROOT = Path(__file__).resolve().parent.parent
F64 = dict(dtype="float64", device="cpu", max_model_len=128, max_num_seqs=3)
# base: GQA 4/2, GDN 2 key / 4 value heads. kv1: one KV head on two ranks (replicated) and a
# vocabulary (251) that two ranks split unevenly. mha: [L, F, L, F], 6 experts top-1.
CONFIGS = {"base": oracle.TINY_CONFIGS["base"],
           "kv1": {**oracle.TINY_CONFIGS["base"], "num_key_value_heads": 1, "vocab_size": 251},
           "mha": oracle.TINY_CONFIGS["mha_hd8_top1"]}
CASES = [(name, k) for name in CONFIGS for k in (2, 3)]
MAX_TOKENS = [12, 7, 16, 10]


def _prompts(name):
    return oracle.random_prompts(4, CONFIGS[name]["vocab_size"], seed=3, lengths=[1, 9, 30, 17])


def _params(temperature=0.0):
    return [SamplingParams(max_tokens=m, ignore_eos=True, temperature=temperature) for m in MAX_TOKENS]


def _run(path, name, k, temperature=0.0, **kw):
    llm = LLM(path, num_spec=k, **F64, **kw)
    outs = llm.generate(_prompts(name), _params(temperature))
    return dict(tokens=[o.token_ids for o in outs], accepted=llm.stats.num_accepted,
                stats=str(llm.stats), logits=llm.score(_prompts(name)[2]), llm=llm)


def _error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares type and message
        return type(e).__name__, str(e)
    return None


def _prefix_prompts():
    shared = oracle.random_prompt(50, CONFIGS["base"]["vocab_size"], seed=11)
    return [shared + oracle.random_prompt(n, CONFIGS["base"]["vocab_size"], seed=n) for n in (5, 9, 14)]


def _prefix_hits(llm):
    """Tokens and num_cached_tokens of prompts sharing a 50-token prefix, one call after another
    (the second and third hit what the first cached)."""
    got = [llm.generate([p], SamplingParams(max_tokens=10, ignore_eos=True))[0] for p in _prefix_prompts()]
    return [(o.token_ids, o.num_cached_tokens) for o in got]


def _tp2_worker(root: str):
    """One rank of the two-process job (module level: debug_launcher forks into it)."""
    from accelerate import PartialState
    # A PartialState made earlier in the pytest process (serve_batch's main run in-process by
    # other tests) is inherited through the fork and would make this rank a lone process.
    PartialState._reset_state()
    state = PartialState(cpu=True)
    torch.set_num_threads(1)
    root, out = Path(root), {}
    for name, k in CASES:
        r = _run(root / name, name, k)
        out[name, k] = {key: r[key] for key in ("tokens", "accepted", "stats", "logits")}
        if k == 2:
            attn = next(layer.self_attn for layer in r["llm"].model.layers if layer.kind == "full_attention")
            # qkv_proj rows: [q | k | gate | v] of this rank's heads (see FullAttention)
            q_rows, kv_rows = attn.heads * attn.hd, attn.kv_heads * attn.hd
            out[name, "k_proj"] = attn.qkv_proj.weight[q_rows:q_rows + kv_rows].clone()
            out[name, "embed_rows"] = r["llm"].model.embed_tokens.shape[0]
    out["sampled"] = _run(root / "base", "base", 2, temperature=0.9)["tokens"]
    out["prefix"] = _prefix_hits(LLM(root / "base", num_spec=2, **F64))
    # Size 1 under two processes: two single-process replicas (data parallel), no group.
    out["size_1"] = LLM(root / "base", num_spec=2, tensor_parallel_size=1, **F64).tp.size
    out["size_4"] = _error(lambda: LLM(root / "base", num_spec=2, tensor_parallel_size=4, **F64))
    out["indivisible"] = _error(lambda: LLM(root / "experts5", num_spec=2, **F64))
    # Rank 1 alone reads a checkpoint that lacks a tensor: both ranks must stop, none hang.
    path = root / ("base" if state.process_index == 0 else "broken")
    out["rank_failure"] = _error(lambda: LLM(path, num_spec=2, **F64))
    torch.save(out, root / f"rank{state.process_index}.pt")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    for name, cfg in CONFIGS.items():
        spec_models.build_spec_checkpoint(root / name, cfg, seed=0, mode="bigram", eps=0.3)
    shutil.copytree(root / "base", root / "broken")
    sd = load_file(root / "broken" / "model.safetensors")
    del sd["model.norm.weight"]
    save_file(sd, root / "broken" / "model.safetensors", metadata={"format": "pt"})
    # Only config.json: a divisibility error must come before any weight is looked for.
    (root / "experts5").mkdir()
    oracle.tiny_config("full_first_dense1").to_json_file(root / "experts5" / "config.json")
    return root


@pytest.fixture(scope="module")
def tp2(checkpoints):
    from accelerate import debug_launcher
    debug_launcher(_tp2_worker, args=(str(checkpoints),), num_processes=2)
    return [torch.load(checkpoints / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("name,k", CASES)
def test_tp2_greedy_equals_tp1(checkpoints, tp2, name, k):
    ref = _run(checkpoints / name, name, k)
    plain = _run(checkpoints / name, name, 0)
    r0, r1 = tp2[0][name, k], tp2[1][name, k]
    assert r0["tokens"] == r1["tokens"] == ref["tokens"] == plain["tokens"]
    assert r0["stats"] == r1["stats"], "the ranks must schedule and accept alike"
    assert r0["accepted"] > 0, "the checkpoint must exercise accepted drafts"
    assert torch.equal(r0["logits"], r1["logits"]), "every rank holds the same gathered logits"
    diff = (r0["logits"] - ref["logits"]).abs().max().item()
    assert diff < 1e-9, f"TP=2 vs TP=1 logits differ by {diff:.3g}"


def test_tp2_prefix_cache_hits_alike_on_every_rank(checkpoints, tp2):
    """Every rank makes the same caching decisions (keys hashed without Python's per-process
    salt) and a hit under TP gives the tokens of an uncached single-process run."""
    r0, r1 = tp2[0]["prefix"], tp2[1]["prefix"]
    assert r0 == r1
    assert [c for _, c in r0][1:] == [48, 48] and r0[0][1] == 0
    off = _prefix_hits(LLM(checkpoints / "base", num_spec=2, enable_prefix_caching=False, **F64))
    assert [t for t, _ in r0] == [t for t, _ in off]


def test_tp2_shards_and_replicates_weights(checkpoints, tp2):
    hd = CONFIGS["base"]["head_dim"]
    # base: 2 KV heads, one per rank; kv1: the single KV head on both ranks.
    assert tp2[0]["base", "k_proj"].shape[0] == hd and not torch.equal(tp2[0]["base", "k_proj"],
                                                                       tp2[1]["base", "k_proj"])
    assert torch.equal(tp2[0]["kv1", "k_proj"], tp2[1]["kv1", "k_proj"])
    assert tp2[0]["kv1", "embed_rows"] == 126 and tp2[0]["base", "embed_rows"] == 128  # ceil(V / 2)


def test_tp2_sampling_identical_on_all_ranks(checkpoints, tp2):
    assert tp2[0]["sampled"] == tp2[1]["sampled"]
    assert tp2[0]["sampled"] == _run(checkpoints / "base", "base", 2, temperature=0.9)["tokens"]


def test_tp_size_must_divide_the_launch(checkpoints, tp2):
    for r in range(2):
        assert tp2[r]["size_1"] == 1
        assert tp2[r]["size_4"][0] == "ConfigError" and "tensor_parallel_size=4" in tp2[r]["size_4"][1]
    with pytest.raises(ConfigError, match="needs 2 processes.*accelerate launch"):
        LLM(checkpoints / "base", num_spec=2, tensor_parallel_size=2, **F64)


@pytest.mark.parametrize("kv,size", [(2, 4), (1, 4), (1, 2), (2, 2), (4, 2)])
def test_each_rank_holds_the_kv_heads_its_query_heads_use(kv, size):
    """Every local query head finds, at its local GQA index, the global KV head it attends to
    in the unsplit model (replicated heads included). No processes needed: ranks are simulated."""
    heads, hd = 8, 4
    full = torch.arange(kv * hd, dtype=torch.float64)[:, None].repeat(1, 3)  # row i: head i // hd
    for rank in range(size):
        held = (KVParallelLinear(3, kv, hd, TP(rank=rank, size=size)).load_full(full)[::hd, 0] // hd).tolist()
        local_q = heads // size
        for i in range(local_q):
            wanted = (rank * local_q + i) // (heads // kv)
            assert held[i // (local_q // len(held))] == wanted, (rank, i, held)


def _config_only(tmp_path, **overrides):
    oracle.tiny_config({**oracle.TINY_CONFIGS["base"], **overrides}).to_json_file(tmp_path / "config.json")
    return tmp_path


@pytest.mark.parametrize("size,overrides,expected", [
    (2, dict(num_experts=5), ["num_experts=5"]),
    (2, dict(linear_num_key_heads=1), ["linear_num_key_heads=1"]),
    (2, dict(num_attention_heads=6, num_key_value_heads=3), ["num_key_value_heads=3"]),
    (4, dict(num_attention_heads=6, num_key_value_heads=2, linear_num_value_heads=6,
             shared_expert_intermediate_size=30), ["num_attention_heads=6", "linear_num_key_heads=2",
                                                   "linear_num_value_heads=6", "shared_expert_intermediate_size=30"]),
])
def test_indivisible_dimensions_refused_before_loading(tmp_path, size, overrides, expected):
    path = _config_only(tmp_path, **overrides)  # no weights: reading any would fail differently
    with pytest.raises(ConfigError) as e:
        LLM(path, num_spec=2, tensor_parallel_size=size, device="cpu")
    for what in expected:
        assert what in str(e.value)


def test_indivisible_under_launch_and_rank_failure_stop_every_rank(tp2):
    for r in range(2):
        assert tp2[r]["indivisible"][0] == "ConfigError" and "num_experts=5" in tp2[r]["indivisible"][1]
    assert tp2[1]["rank_failure"][0] == "CheckpointError" and "model.norm.weight" in tp2[1]["rank_failure"][1]
    kind, msg = tp2[0]["rank_failure"]
    assert kind == "CheckpointError" and "rank 1" in msg and "model.norm.weight" in msg


# ---- examples/serve_batch.py -----------------------------------------------------------------

def _serve(cmd, tmp_path, path, *extra):
    out = tmp_path / "out.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["examples/serve_batch.py", "--model", str(path), "--output", str(out), "--num-spec", "2",
            "--max-tokens", "6", "--dtype", "float64", "--max-model-len", "128", "--ignore-eos", *extra]
    proc = subprocess.run(cmd + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()], proc.stdout


def test_serve_batch_under_accelerate_launch(checkpoints, tmp_path):
    launcher = Path(sys.executable).parent / "accelerate"
    # accelerate is a runtime dependency: its command must be installed beside this python
    assert launcher.exists(), f"{launcher} is missing: pip install accelerate"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prompts = _prompts("base")[:3]
    lines = [{"prompt_token_ids": p} for p in prompts[:2]] + [{"prompt": "no tokenizer here"},
                                                                {"prompt_token_ids": prompts[2]}]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    cmd = [str(launcher), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(port)]
    rows, stdout = _serve(cmd, tmp_path, checkpoints / "base", "--prompts", str(tmp_path / "in.jsonl"),
                          "--keep-going")  # the text line (no tokenizer) becomes an error record
    llm = LLM(checkpoints / "base", num_spec=2, **F64)
    ref = llm.generate([prompts[0], prompts[1], prompts[2]], SamplingParams(max_tokens=6, ignore_eos=True))
    assert [r["index"] for r in rows] == [0, 1, 2, 3]
    assert [rows[i]["token_ids"] for i in (0, 1, 3)] == [o.token_ids for o in ref]
    assert "tokenizer" in rows[2]["error"] and rows[2]["token_ids"] == []
    for r in (rows[0], rows[1], rows[3]):
        assert r["finish_reason"] == "length" and "text" in r
        assert r["num_drafted"] >= r["num_accepted"] >= 0 and "acceptance_rate" in r
    assert "tok/s" in stdout and "tensor parallel 2" in stdout and "acceptance" in stdout


def test_serve_batch_single_process_builtin_samples(checkpoints, tmp_path):
    rows, stdout = _serve([sys.executable], tmp_path, checkpoints / "base")
    assert len(rows) == 4 and all(len(r["token_ids"]) == 6 for r in rows)
    assert "tensor parallel 1" in stdout
