"""examples/serve_batch.py over a job's life (issue 31, items 6 and 7): an edited input line is
generated again on --resume (its fingerprint no longer matches), changed settings redo every
line, unchanged lines are kept; error records carry text "" rather than null."""

import importlib.util
import json
from pathlib import Path

import pytest

from mtpkit import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--model", "tiny-qwen3-next", "--num-spec", "2", "--max-tokens", "5", "--ignore-eos", "--cpu"]


@pytest.fixture
def serve_batch():
    spec = importlib.util.spec_from_file_location("serve_batch", ROOT / "examples" / "serve_batch.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(mod, tmp_path, *extra):
    rc = mod.main(ARGS + ["--prompts", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"), *extra])
    assert rc == 0
    return [json.loads(ln) for ln in (tmp_path / "out.jsonl").read_text().splitlines()]


def _write(tmp_path, prompts):
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))


def _expected(prompt, max_tokens=5):
    return LLM("tiny-qwen3-next").generate(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0].token_ids


def test_resume_generates_an_edited_line_again(serve_batch, tmp_path, capsys):
    _write(tmp_path, ["def f(x):", "import os", "class A:"])
    first = _run(serve_batch, tmp_path)
    _write(tmp_path, ["def f(x):", "Once upon a time", "class A:"])    # line 2 edited
    second = _run(serve_batch, tmp_path, "--resume")
    err = capsys.readouterr().err
    assert "input line(s) [2] changed" in err, err
    assert second[1]["token_ids"] == _expected("Once upon a time") != first[1]["token_ids"]
    assert [second[0], second[2]] == [first[0], first[2]]               # kept as written


def test_resume_with_changed_settings_redoes_every_line(serve_batch, tmp_path, capsys):
    _write(tmp_path, ["def f(x):", "import os"])
    _run(serve_batch, tmp_path)
    again = _run(serve_batch, tmp_path, "--resume", "--max-tokens", "3")
    assert "[1, 2] changed" in capsys.readouterr().err
    assert [r["token_ids"] for r in again] == [_expected("def f(x):", 3), _expected("import os", 3)]


def test_resume_of_an_unchanged_job_has_nothing_to_do(serve_batch, tmp_path, capsys):
    _write(tmp_path, ["def f(x):"])
    _run(serve_batch, tmp_path)
    capsys.readouterr()
    _run(serve_batch, tmp_path, "--resume")
    assert "nothing to do" in capsys.readouterr().out


def test_error_records_have_empty_text(serve_batch, tmp_path):
    (tmp_path / "in.jsonl").write_text('{"prompt": "def f(x):"}\n{"nope": 1}\n')
    recs = _run(serve_batch, tmp_path, "--keep-going")
    assert recs[1]["finish_reason"] == "error" and recs[1]["text"] == "" and recs[0]["text"]


def test_logprobs_are_written_per_token(serve_batch, tmp_path):
    _write(tmp_path, ["def f(x):", "import os"])
    recs = _run(serve_batch, tmp_path, "--logprobs", "2", "--prompt-logprobs", "1")
    llm = LLM("tiny-qwen3-next")
    for rec, prompt in zip(recs, ["def f(x):", "import os"]):
        ref = llm.generate(prompt, SamplingParams(max_tokens=5, ignore_eos=True, logprobs=2, prompt_logprobs=1))[0]
        assert rec["token_ids"] == ref.token_ids and len(rec["logprobs"]) == len(ref.token_ids)
        for pos, t, entry in zip(rec["logprobs"], ref.token_ids, ref.logprobs):
            assert pos[0]["token_id"] == t and pos[0]["decoded_token"] == llm.tokenizer.decode([t])
            assert {e["token_id"] for e in pos} == set(entry)
            for e in pos:
                assert abs(e["logprob"] - entry[e["token_id"]].logprob) < 1e-5 and e["rank"] == entry[e["token_id"]].rank
        assert rec["prompt_logprobs"][0] is None and len(rec["prompt_logprobs"]) == len(ref.prompt_token_ids)
        assert [p[0]["token_id"] for p in rec["prompt_logprobs"][1:]] == ref.prompt_token_ids[1:]
    plain = _run(serve_batch, tmp_path)
    assert "logprobs" not in plain[0] and [r["token_ids"] for r in plain] == [r["token_ids"] for r in recs]


def test_bad_logprobs_flag_is_refused_before_the_model_loads(serve_batch, tmp_path, capsys):
    _write(tmp_path, ["def f(x):"])
    rc = serve_batch.main(ARGS + ["--prompts", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o.jsonl"),
                                  "--logprobs", "-1"])
    assert rc != 0 and "logprobs=-1" in capsys.readouterr().err and not (tmp_path / "o.jsonl").exists()


def test_n_samples_per_line(serve_batch, tmp_path):
    """A line's "n": every sample in its record's "samples" (the top-level fields are sample
    0's), the tokens LLM.generate gives with n; a bad "n" is an error record."""
    lines = [{"prompt": "def f(x):", "n": 3}, {"prompt": "import os"}, {"prompt": "x", "n": 0}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(rec) + "\n" for rec in lines))
    recs = _run(serve_batch, tmp_path, "--keep-going", "--temperature", "0.8")
    params = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.8)
    want = LLM("tiny-qwen3-next").generate(["def f(x):", "import os"], [SamplingParams(**{**vars(params), "n": 3}),
                                                                      params])
    assert [s["token_ids"] for s in recs[0]["samples"]] == [c.token_ids for c in want[0].outputs]
    assert [s["index"] for s in recs[0]["samples"]] == [0, 1, 2]
    assert recs[0]["token_ids"] == recs[0]["samples"][0]["token_ids"]
    assert "samples" not in recs[1] and recs[1]["token_ids"] == want[1].token_ids
    assert recs[2]["finish_reason"] == "error" and '"n" must be an int >= 1' in recs[2]["error"]
