"""The embedded tiny-qwen3-next: loads by name, matches transformers, drives the CLI main
job and the quick-start notebook."""

import subprocess
import sys
from pathlib import Path

import torch

import oracle
from mtpkit import LLM, SamplingParams
from mtpkit.checkpoint.hub import builtin_models, resolve_model

ROOT = Path(__file__).resolve().parents[1]
NAME = "tiny-qwen3-next"


def test_embedded_model_is_built_in():
    assert NAME in builtin_models()
    path = resolve_model(NAME)
    for f in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (path / f).exists(), f
    size = (path / "model.safetensors").stat().st_size
    assert size < 16 << 20, f"the embedded checkpoint should stay a few MB, is {size >> 20} MB"


def test_loads_by_name_and_generates_python():
    llm = LLM(NAME, num_spec=3)
    out = llm.generate("def fibonacci(n):", SamplingParams(max_tokens=48))[0]
    assert len(out.token_ids) > 0 and out.text
    assert llm.tokenizer.decode(llm.tokenizer.encode("x = {'a': 1}\n\tü").ids) == "x = {'a': 1}\n\tü"
    assert llm.stats.verify_steps > 0 and llm.stats.mean_acceptance_length > 1.0


def test_transformers_parity_on_embedded_model():
    path = resolve_model(NAME)
    hf = oracle.load_hf_model(path, dtype=torch.float64)
    llm = LLM(NAME, dtype="float64")
    ids = llm.tokenizer.encode("import os\nimport sys\n\ndef main(argv):\n    ").ids
    ref = oracle.hf_logits(hf, ids)
    ours = llm.score(ids).double()
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()
    out = llm.generate([ids], SamplingParams(max_tokens=40, ignore_eos=True))[0].token_ids
    report = oracle.check_greedy_against_hf(hf, ids, out)
    assert report.ok, str(report)
    mtp = LLM(NAME, dtype="float64", num_spec=3).generate([ids], SamplingParams(max_tokens=40, ignore_eos=True))
    assert mtp[0].token_ids == out


def test_cli_main_job_prints_acceptance_stats():
    r = subprocess.run([sys.executable, "-m", "mtpkit.cli", "generate", "def fibonacci(n):", "--num-spec", "3",
                        "--max-tokens", "24"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "mean acceptance length" in r.stdout and "tok/s" in r.stdout


def test_cli_reports_errors_cleanly():
    r = subprocess.run([sys.executable, "-m", "mtpkit.cli", "generate", "x", "--num-spec", "12"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 2 and "num_spec=12" in r.stderr and "Traceback" not in r.stderr


# The quick-start notebook is executed (and its view checked) in test_notebook.py.
