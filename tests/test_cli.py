"""The command line as a user runs it (issue 31, item 5): the dtype default its help states,
--max-num-seqs, several prompts and `-` for standard input, --n samples, a closed pipe, and
draft positions never tried."""

import dataclasses
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mtpkit
from mtpkit import LLM, cli

ROOT = Path(__file__).resolve().parents[1]


class _Captured(Exception):
    pass


@pytest.fixture
def llm_kwargs(monkeypatch):
    """What the CLI passes to LLM (the call stops there: no weights are read)."""
    seen = {}

    def fake(model, **kw):
        seen.update(kw, model=model)
        raise _Captured
    monkeypatch.setattr(mtpkit, "LLM", fake)
    return seen


def test_dtype_default_is_auto_as_its_help_says(llm_kwargs):
    with pytest.raises(_Captured):
        cli.main(["generate", "x"])
    assert llm_kwargs["dtype"] == "auto"   # float32 on CPU, the checkpoint's dtype on CUDA
    assert "auto" in cli._parser()._subparsers._group_actions[0].choices["generate"].format_help()


def test_max_num_seqs_reaches_the_engine(llm_kwargs):
    with pytest.raises(_Captured):
        cli.main(["generate", "x", "--max-num-seqs", "3"])
    assert llm_kwargs["max_num_seqs"] == 3
    with pytest.raises(SystemExit):
        cli.main(["generate", "x", "--max-num-seqs", "0"])


def test_draft_dtype_reaches_the_engine(llm_kwargs):
    with pytest.raises(_Captured):
        cli.main(["generate", "x", "--num-spec", "3", "--draft-dtype", "bfloat16"])
    assert llm_kwargs["draft_dtype"] == "bfloat16"
    with pytest.raises(_Captured):
        cli.main(["generate", "x"])
    assert llm_kwargs["draft_dtype"] == "auto"


def test_num_scheduler_steps_reaches_the_engine(llm_kwargs):
    with pytest.raises(_Captured):
        cli.main(["generate", "x", "--num-scheduler-steps", "4"])
    assert llm_kwargs["num_scheduler_steps"] == 4
    with pytest.raises(_Captured):
        cli.main(["generate", "x"])
    assert llm_kwargs["num_scheduler_steps"] == 1


def test_num_scheduler_steps_with_drafts_is_refused_by_name(capsys):
    assert cli.main(["generate", "x", "--num-spec", "3", "--num-scheduler-steps", "4"]) == 2
    assert "num_scheduler_steps=4" in capsys.readouterr().err


def test_several_prompts_run_as_one_batch_each_printed_under_its_number(capsys):
    prompts = ["def fibonacci(n):", "import os\n"]
    assert cli.main(["generate", *prompts, "--max-tokens", "12"]) == 0
    out = capsys.readouterr().out
    llm = LLM("tiny-qwen3-next", num_spec=3)   # the CLI applies the checkpoint's penalties (generation_config.json)
    expected = llm.generate(prompts, dataclasses.replace(llm.generation_defaults.sampling_params(), max_tokens=12))
    first, second = out.split("=== [1]")
    assert first.startswith("=== [0] 'def fibonacci(n):'\n") and expected[0].text in first
    assert expected[1].text in second and "--- 24 tokens in" in second


def test_n_prints_every_sample(capsys):
    """--n 3: each sample under its number (sample i with --seed + i), stats over all; n > 1
    with greedy decoding is refused with the fix."""
    assert cli.main(["generate", "def f(x):", "--n", "3", "--temperature", "0.8", "--seed", "5",
                     "--max-tokens", "6"]) == 0
    out = capsys.readouterr().out
    llm = LLM("tiny-qwen3-next", num_spec=3)
    defaults = llm.generation_defaults.sampling_params()   # the CLI applies the checkpoint's penalties
    want = llm.generate(["def f(x):"] * 3, [dataclasses.replace(defaults, max_tokens=6, temperature=0.8, seed=5 + i)
                                            for i in range(3)])
    parts = out.split("--- sample ")
    assert [p[0] for p in parts[1:]] == ["0", "1", "2"]
    for part, o in zip(parts[1:], want):
        assert part.startswith(f"{parts.index(part) - 1}\n{o.text}")
    assert "--- 18 tokens in" in out
    assert cli.main(["generate", "def f(x):", "--n", "2"]) == 2
    assert "set temperature > 0" in capsys.readouterr().err


def test_dash_reads_the_prompt_from_stdin(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("def fibonacci(n):\n"))
    assert cli.main(["generate", "-", "--max-tokens", "8", "--num-spec", "0"]) == 0
    llm = LLM("tiny-qwen3-next")
    text = llm.generate("def fibonacci(n):", dataclasses.replace(llm.generation_defaults.sampling_params(),
                                                                 max_tokens=8))[0].text
    assert capsys.readouterr().out.startswith(text)


def test_draft_positions_never_tried_print_as_a_dash(capsys):
    # 2 tokens: the prefill's token and one verify step that drafts only what fits (1 draft)
    assert cli.main(["generate", "def f(", "--max-tokens", "3", "--num-spec", "4"]) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if "acceptance per position" in ln][0]
    rates = line.split("[")[1].rstrip("]").split(", ")
    assert len(rates) == 4 and rates[-1] == "-" and rates[0] != "-", line


def test_a_closed_pipe_ends_quietly():
    """`mtpkit generate ... | head -c 10`: the reader leaves early; no BrokenPipeError traceback."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen([sys.executable, "-m", "mtpkit", "generate", "x", "--max-tokens", "1500"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=env)
    p.stdout.read(10)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 0 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_logprobs_flag_prints_each_tokens_logprob_and_the_likeliest(capsys):
    assert cli.main(["generate", "def f(x):", "--max-tokens", "6", "--logprobs", "2"]) == 0
    out = capsys.readouterr().out
    llm = LLM("tiny-qwen3-next")
    ref = llm.generate("def f(x):", dataclasses.replace(llm.generation_defaults.sampling_params(), max_tokens=6,
                                                        logprobs=2))[0]
    rows = out.split("--- logprobs")[1].splitlines()[1:1 + len(ref.token_ids)]
    assert len(rows) == len(ref.token_ids)
    for row, t, entry in zip(rows, ref.token_ids, ref.logprobs):
        assert row.strip().startswith(repr(ref.tokenizer.decode([t]))), row
        assert f"{entry[t].logprob:9.4f} {entry[t].rank:5d}" in row, row
        others = [lp for k, lp in entry.items() if k != t]
        assert all(f"{lp.logprob:.3f}" in row for lp in others), row
