"""examples/serve_batch.py as data parallel x tensor parallel, and resumable.

One `accelerate.debug_launcher` job of 4 gloo processes (module fixture `dp4`) runs the script's
own steps (check_inputs, run) as DP 2 x TP 2, as DP 4 x TP 1, and as DP 2 x TP 2 resuming a
killed single-process run; the tests compare the files with a single-process run made here.
float64 and greedy: TP sums partial products in another order, and the tokens must not move.
"""

import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import oracle
import spec_models

# accelerate's launchers meet on a fixed port: this file takes turns with the others that start them (conftest)
pytestmark = pytest.mark.fixed_port

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "serve_batch.py"
CFG = oracle.TINY_CONFIGS["base"]
LENGTHS = [3, 40, 7, 25, 1, 12, 30, 5]
COMMON = ["--num-spec", "2", "--max-tokens", "6", "--dtype", "float64", "--max-model-len", "128",
          "--ignore-eos", "--max-num-seqs", "3"]


def _module():
    spec = importlib.util.spec_from_file_location("serve_batch", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _args(root: Path, out: str, *extra) -> list[str]:
    return ["--model", str(root / "model"), "--prompts", str(root / "in.jsonl"), "--output", str(root / out),
            *COMMON, *extra]


def _dp4_worker(root: str):
    """One of the four ranks (module level: debug_launcher forks into it)."""
    from accelerate import PartialState
    # A PartialState made earlier in the pytest process (serve_batch's main run in-process by
    # other tests) is inherited through the fork and would make this rank a lone process.
    PartialState._reset_state()
    state = PartialState(cpu=True)
    torch.set_num_threads(1)
    root, mod = Path(root), _module()
    for out, extra in [("tp2.jsonl", ["--tensor-parallel-size", "2"]),
                       ("tp1.jsonl", ["--tensor-parallel-size", "1"]),
                       ("killed.jsonl", ["--tensor-parallel-size", "2", "--resume"])]:
        args = mod._parser().parse_args(_args(root, out, *extra))
        prompts, lines = mod.check_inputs(args)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert mod.run(args, prompts, lines, state, cpu=True) == 0
        if state.is_main_process:
            (root / f"{out}.stdout").write_text(printed.getvalue())
    # One prompt too long for max_model_len, dealt to one replica: every rank refuses the batch.
    args = mod._parser().parse_args(_args(root, "long-out.jsonl", "--tensor-parallel-size", "1"))
    args.prompts = str(root / "long.jsonl")
    prompts, lines = mod.check_inputs(args)
    try:
        mod.run(args, prompts, lines, state, cpu=True)
        refused = None
    except mod.InputError as e:
        refused = str(e)
    (root / f"long.rank{state.process_index}").write_text(json.dumps(refused))


def _serve(root: Path, out: str, *extra, rc: int = 0):
    proc = subprocess.run([sys.executable, str(SCRIPT), *_args(root, out, *extra)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == rc, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp")
    spec_models.build_spec_checkpoint(root / "model", CFG, seed=0, mode="bigram", eps=0.3)
    prompts = oracle.random_prompts(len(LENGTHS), CFG["vocab_size"], seed=5, lengths=LENGTHS)
    # A blank line: records carry the file's line numbers, not the prompt's position.
    lines = [json.dumps({"prompt_token_ids": p}) for p in prompts]
    (root / "in.jsonl").write_text("\n".join(lines[:3] + [""] + lines[3:]) + "\n")
    (root / "long.jsonl").write_text("\n".join(lines[:3] + [json.dumps({"prompt_token_ids": [1] * 125})]) + "\n")
    single = _serve(root, "single.jsonl")
    # Killed after 3 requests: its part file is what the 4-process job resumes from.
    _serve(root, "killed.jsonl", "--exit-after", "3", rc=3)
    return root, single


@pytest.fixture(scope="module")
def dp4(job):
    from accelerate import debug_launcher
    root, _ = job
    killed_before = [json.loads(x) for p in root.glob("killed.jsonl.part-*") for x in p.read_text().splitlines()]
    debug_launcher(_dp4_worker, args=(str(root),), num_processes=4)
    return root, killed_before


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_single_process_file_is_in_input_order_with_line_numbers(job):
    root, stdout = job
    rows = _rows(root / "single.jsonl")
    assert [r["index"] for r in rows] == list(range(len(LENGTHS)))
    assert [r["line"] for r in rows] == [1, 2, 3, 5, 6, 7, 8, 9]
    assert all(len(r["token_ids"]) == 6 for r in rows)
    assert "8/8 requests generated (0 already written)" in stdout
    assert sum(r["num_accepted"] for r in rows) > 0, "the checkpoint must exercise accepted drafts"


@pytest.mark.parametrize("out,replicas,tp", [("tp2.jsonl", 2, 2), ("tp1.jsonl", 4, 1)])
def test_dp_x_tp_file_equals_single_process(job, dp4, out, replicas, tp):
    root, _ = dp4
    assert (root / out).read_text() == (root / "single.jsonl").read_text()
    assert not list(root.glob(out + ".part-*")), "part files are removed once the output holds them"
    stdout = (root / f"{out}.stdout").read_text()
    assert f"replicas {replicas} x tensor parallel {tp}" in stdout and "8/8 requests generated" in stdout
    # Per-replica counts: every replica got work and together they did all of it.
    per = stdout.split("per replica: ")[1].splitlines()[0].split(", ")
    counts = [int(p.split(": ")[1].split()[0]) for p in per]
    assert len(counts) == replicas and sum(counts) == 8 and min(counts) >= 1


def test_resume_after_a_kill_generates_only_the_rest(job, dp4):
    root, killed_before = dp4
    assert len(killed_before) == 3, "the killed run wrote its first 3 requests, flushed, before dying"
    assert (root / "killed.jsonl").read_text() == (root / "single.jsonl").read_text()
    assert "5/8 requests generated (3 already written)" in (root / "killed.jsonl.stdout").read_text()
    # Finished: running again does nothing and says so.
    before = (root / "killed.jsonl").stat().st_mtime_ns
    stdout = _serve(root, "killed.jsonl", "--resume")
    assert "nothing to do: all 8 prompts are already in" in stdout
    assert (root / "killed.jsonl").stat().st_mtime_ns == before


def test_shards_balance_prompt_length_not_count():
    mod = _module()
    # One long prompt against many short ones: counts would give each replica 3.
    shards = mod.shard({0: 100, 1: 10, 2: 10, 3: 10, 4: 10, 5: 10}, 2)
    assert shards == [[0], [1, 2, 3, 4, 5]]


def _refused(monkeypatch, capsys, root: Path, world: int, *extra) -> str:
    mod = _module()

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the layout was checked")
    monkeypatch.setattr(mod, "LLM", no_model)
    monkeypatch.setenv("WORLD_SIZE", str(world))  # as a launcher sets it, before any process group
    rc = mod.main(["--model", str(root), "--output", str(root / "o.jsonl"), "--num-spec", "2", *extra])
    assert rc == 2
    return capsys.readouterr().err


def test_layout_errors_before_any_weight(monkeypatch, capsys, tmp_path):
    # config.json only: reading any weight would fail with another error.
    oracle.tiny_config({**CFG, "num_experts": 6}).to_json_file(tmp_path / "config.json")
    err = _refused(monkeypatch, capsys, tmp_path, 4, "--tensor-parallel-size", "3")
    assert "tensor_parallel_size=3 does not divide the 4 launched processes" in err, err
    err = _refused(monkeypatch, capsys, tmp_path, 4, "--tensor-parallel-size", "0")
    assert "--tensor-parallel-size 0 must be >= 1" in err, err
    err = _refused(monkeypatch, capsys, tmp_path, 4, "--tensor-parallel-size", "4")
    assert "num_experts=6" in err and "tensor_parallel_size" in err, err


def test_resume_over_a_half_written_line(job):
    """A run killed mid-write leaves half a record: it is skipped, and the next run's records
    start on a new line, so they are found by the run after."""
    root, _ = job
    done = (root / "single.jsonl").read_text().splitlines()
    (root / "torn.jsonl.part-0-of-1").write_text("\n".join(done[:2]) + "\n" + done[2][:30])
    _serve(root, "torn.jsonl", "--resume", "--exit-after", "1", rc=3)  # killed again, after 1 more
    stdout = _serve(root, "torn.jsonl", "--resume")
    assert "5/8 requests generated (3 already written)" in stdout, stdout
    assert (root / "torn.jsonl").read_text() == (root / "single.jsonl").read_text()


def test_a_prompt_the_engine_cannot_run_stops_every_replica(dp4):
    root, _ = dp4
    for rank in range(4):
        refused = json.loads((root / f"long.rank{rank}").read_text())
        assert refused and f"{root / 'long.jsonl'}:4" in refused and "max_model_len" in refused, (rank, refused)
    assert not list(root.glob("long-out.jsonl*")), "refused before any part file is opened"
