"""The user-facing edges: named errors for bad devices and tokenizer files, incremental
detokenization of streamed text, the command line (help, validation, Ctrl-C, python -m mtpkit),
examples/serve_batch.py's input checks, and the CPU path never importing Triton.

Everything here runs on the embedded tiny model or on no model at all (< 60 s in all)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mtpkit
import mtpkit.models.loader as loader_mod
from mtpkit import LLM, CheckpointError, ConfigError, SamplingParams
from mtpkit.models.registry import resolve_model

ROOT = Path(__file__).resolve().parent.parent
TINY = resolve_model("tiny-qwen3-next")


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture
def no_weights(monkeypatch):
    """Fail if the weights are loaded."""
    def fail(*a, **k):
        raise AssertionError("the weights were loaded before the error was raised")
    monkeypatch.setattr(loader_mod, "load_checkpoint", fail)


@pytest.fixture
def tiny_copy(tmp_path):
    dst = tmp_path / "tiny"
    shutil.copytree(TINY, dst)
    return dst


# ---------------------------------------------------------------------------------------------
# named errors: device, tokenizer.json
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["tpu", "mps", "cpu:x"])
def test_unsupported_device_is_a_config_error(device, no_weights):
    with pytest.raises(ConfigError) as ei:
        LLM("tiny-qwen3-next", device=device)
    msg = str(ei.value)
    assert repr(device) in msg and "'cpu'" in msg and "'cuda'" in msg, msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda")])
def test_cuda_without_a_gpu_is_a_config_error(device, no_weights):
    with pytest.raises(ConfigError) as ei:
        LLM("tiny-qwen3-next", device=device)
    msg = str(ei.value)
    assert "no CUDA device" in msg and "device='cpu'" in msg and "Triton" not in msg, msg


def test_resolve_device():
    from mtpkit.config import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    assert resolve_device(None) == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ConfigError):
        resolve_device(3.5)


@pytest.mark.parametrize("content", ['{"version": "1.0", ', "", '{"model": {"type": "Nope"}}'])
def test_corrupt_tokenizer_json_named_before_the_weights_load(tiny_copy, content, no_weights):
    f = tiny_copy / "tokenizer.json"
    f.write_text(content)
    with pytest.raises(CheckpointError) as ei:
        LLM(tiny_copy)
    assert str(f) in str(ei.value), str(ei.value)


def test_tokenizer_larger_than_the_model_vocab(tiny_copy, no_weights):
    cfg = json.loads((tiny_copy / "config.json").read_text())
    cfg["vocab_size"] = 200
    (tiny_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as ei:
        LLM(tiny_copy)
    msg = str(ei.value)
    assert "tokenizer.json" in msg and "200" in msg and "257" in msg, msg
