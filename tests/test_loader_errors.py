"""Checkpoint and configuration errors: one clear error, raised before model work.

- A checkpoint with missing, unexpected and misshapen tensors raises ONE CheckpointError that
  names every offending tensor with its expected and found shape, from the safetensors headers
  alone (no tensor data is read: ``safe_open`` in the loader is replaced by a proxy that fails on
  ``get_tensor``).
- Missing weight files raise a CheckpointError naming the file.
- Configuration problems (model_type, layer_types values, head counts, num_spec > 0 without mtp.*
  weights, ...) raise ConfigError before the model is built or the loader runs (both patched to
  fail if reached).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import oracle as O  # noqa: E402

pytest.importorskip("transformers")

import mtpkit.checkpoint.loader as loader_mod  # noqa: E402
import mtpkit.models.qwen3_next.model as qwen_mod  # noqa: E402
from mtpkit import LLM, CheckpointError, ConfigError, MtpkitError  # noqa: E402

SEED = 0
FAST_S = 1.0  # "well under a second": these errors need only config.json and safetensors headers


def _llm(path, **kw) -> LLM:
    kw.setdefault("dtype", "float64")
    kw.setdefault("device", "cpu")
    kw.setdefault("max_model_len", 128)
    kw.setdefault("enforce_eager", True)
    return LLM(path, **kw)


@pytest.fixture
def header_only(monkeypatch):
    """Replace the loader's safe_open by a proxy that allows headers only; returns a counter."""
    real = loader_mod.safe_open
    reads = {"get_tensor": 0, "opened": 0}

    class HeaderOnly:
        def __init__(self, *a, **k):
            reads["opened"] += 1
            self._f = real(*a, **k)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def keys(self):
            return self._f.keys()

        def metadata(self):
            return self._f.metadata()

        def get_slice(self, name):
            return self._f.get_slice(name)

        def get_tensor(self, name):
            reads["get_tensor"] += 1
            raise AssertionError(f"tensor data of {name} read before the checkpoint was validated")

    monkeypatch.setattr(loader_mod, "safe_open", HeaderOnly)
    return reads


@pytest.fixture
def no_model_work(monkeypatch):
    """Fail if the model is built or the loader is called."""
    calls = []

    def fail(what):
        def f(*a, **k):
            calls.append(what)
            raise AssertionError(f"{what} reached before the configuration error was raised")
        return f

    monkeypatch.setattr(loader_mod, "load_checkpoint", fail("load_checkpoint"))
    monkeypatch.setattr(qwen_mod, "Qwen3NextForCausalLM", fail("Qwen3NextForCausalLM()"))
    return calls


def _copy(path, dst):
    shutil.copytree(path, dst)
    return dst


def _edit_config(ck, **changes):
    cfg = json.loads((ck / "config.json").read_text())
    for k, v in changes.items():
        if v is _DELETE:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (ck / "config.json").write_text(json.dumps(cfg, indent=2))


_DELETE = object()


def _raises_fast(exc_type, fn):
    t0 = time.perf_counter()
    with pytest.raises(exc_type) as ei:
        fn()
    elapsed = time.perf_counter() - t0
    assert elapsed < FAST_S, f"the error took {elapsed:.2f}s"
    return str(ei.value)


# ---------------------------------------------------------------------------------------------
# checkpoint contents
# ---------------------------------------------------------------------------------------------


def _line_of(msg: str, name: str) -> str:
    lines = [ln for ln in msg.splitlines() if name in ln]
    assert lines, f"{name} not mentioned in the error:\n{msg}"
    return lines[0]


def test_every_offending_tensor_in_one_error(hf_checkpoint, tmp_path, header_only):
    from safetensors import safe_open
    from safetensors.torch import save_file

    _, path = hf_checkpoint("base", SEED, with_mtp=True)
    ck = _copy(path, tmp_path / "ck")
    f = ck / "model.safetensors"
    with safe_open(str(f), "pt") as fh:
        meta = fh.metadata()
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    missing = ["model.layers.0.linear_attn.A_log", "model.layers.3.mlp.experts.1.down_proj.weight"]
    missing_shapes = {n: list(tensors[n].shape) for n in missing}
    for n in missing:
        del tensors[n]
    unexpected = "model.layers.1.self_attn.q_proj.weight"  # layer 1 is a GDN layer in "base"
    tensors[unexpected] = torch.zeros(3, 5, dtype=torch.float64)
    misshapen = "model.layers.3.self_attn.q_proj.weight"
    expected_shape = list(tensors[misshapen].shape)
    tensors[misshapen] = torch.zeros(expected_shape[0] + 2, expected_shape[1], dtype=torch.float64)
    save_file(tensors, str(f), metadata=meta)

    msg = _raises_fast(CheckpointError, lambda: _llm(ck))
    assert header_only["get_tensor"] == 0
    for n in missing:
        line = _line_of(msg, n)
        assert "missing" in line and str(missing_shapes[n]) in line, line
    line = _line_of(msg, unexpected)
    assert "unexpected" in line and "[3, 5]" in line, line
    line = _line_of(msg, misshapen)
    assert str(expected_shape) in line and str([expected_shape[0] + 2, expected_shape[1]]) in line, line
    assert line.index(str(expected_shape)) < line.index(str([expected_shape[0] + 2, expected_shape[1]])), \
        f"expected shape should come before the found one: {line}"
    # the mtp.* tensors are not reported with num_spec=0
    assert "mtp." not in msg


def test_bad_mtp_tensor_reported_with_num_spec(hf_checkpoint, tmp_path, header_only, monkeypatch):
    from safetensors import safe_open
    from safetensors.torch import save_file

    _, path = hf_checkpoint("base", SEED, with_mtp=True)
    ck = _copy(path, tmp_path / "ck")
    f = ck / "model.safetensors"
    with safe_open(str(f), "pt") as fh:
        meta = fh.metadata()
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    del tensors["mtp.fc.weight"]
    tensors["mtp.norm.weight"] = torch.zeros(7, dtype=torch.float64)
    save_file(tensors, str(f), metadata=meta)
    msg = _raises_fast(CheckpointError, lambda: _llm(ck, num_spec=1))
    assert header_only["get_tensor"] == 0
    assert "[64, 128]" in _line_of(msg, "mtp.fc.weight")
    line = _line_of(msg, "mtp.norm.weight")
    assert "[64]" in line and "[7]" in line
    # with num_spec=0 the (broken) MTP head is not needed and the checkpoint loads
    monkeypatch.undo()  # real safe_open again
    _llm(ck, num_spec=0)


def test_missing_model_safetensors(hf_checkpoint, tmp_path, header_only):
    _, path = hf_checkpoint("base", SEED, with_mtp=False)
    ck = _copy(path, tmp_path / "ck")
    (ck / "model.safetensors").unlink()
    msg = _raises_fast(CheckpointError, lambda: _llm(ck))
    assert "model.safetensors" in msg and str(ck) in msg
    assert header_only["get_tensor"] == 0


@pytest.mark.parametrize("how", ["truncated", "empty"])
def test_truncated_or_empty_model_safetensors(hf_checkpoint, tmp_path, how, no_model_work):
    """safetensors' own error names no file: the CheckpointError names it and says what is wrong."""
    _, path = hf_checkpoint("base", SEED, with_mtp=False)
    ck = _copy(path, tmp_path / "ck")
    f = ck / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if how == "truncated" else b"")
    msg = _raises_fast(CheckpointError, lambda: _llm(ck))
    assert str(f) in msg and "truncated or corrupt" in msg, msg
    assert not no_model_work


def test_truncated_shard_of_an_index(hf_checkpoint, tmp_path):
    model, _ = hf_checkpoint("base", SEED, with_mtp=False)
    ck = O.save_checkpoint(model, tmp_path / "sharded", shard_size="40KB")
    index = json.loads((ck / "model.safetensors.index.json").read_text())
    bad = ck / sorted(set(index["weight_map"].values()))[1]
    bad.write_bytes(bad.read_bytes()[:-100])
    msg = _raises_fast(CheckpointError, lambda: _llm(ck))
    assert str(bad) in msg and "truncated or corrupt" in msg, msg


def test_missing_shard_of_an_index(hf_checkpoint, tmp_path, header_only):
    model, _ = hf_checkpoint("base", SEED, with_mtp=False)
    ck = O.save_checkpoint(model, tmp_path / "sharded", shard_size="40KB")
    index = json.loads((ck / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[1]
    (ck / gone).unlink()
    msg = _raises_fast(CheckpointError, lambda: _llm(ck))
    assert gone in msg
    assert header_only["get_tensor"] == 0


def test_checkpoint_error_is_an_mtpkit_error():
    assert issubclass(CheckpointError, MtpkitError) and issubclass(ConfigError, MtpkitError)


# ---------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------

_F, _L = "full_attention", "linear_attention"

BAD_CONFIGS = {
    "model_type": (dict(model_type="llama"), ["model_type", "llama", "qwen3_next"]),
    "layer_types_value": (dict(layer_types=[_L, _L, "sliding_attention", _F]),
                          ["layer_types", "sliding_attention", _L, _F]),
    "layer_types_length": (dict(layer_types=[_L, _F]), ["layer_types", "num_hidden_layers"]),
    "attention_heads_not_divisible": (dict(num_key_value_heads=3),
                                      ["num_attention_heads=4", "num_key_value_heads=3"]),
    "linear_heads_not_divisible": (dict(linear_num_value_heads=3),
                                   ["linear_num_value_heads=3", "linear_num_key_heads=2"]),
    "top_k_above_experts": (dict(num_experts_per_tok=5), ["num_experts_per_tok=5", "num_experts=4"]),
    "rope_type": (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                                        "partial_rotary_factor": 0.25}), ["rope_type", "yarn"]),
    "hidden_act": (dict(hidden_act="gelu"), ["hidden_act", "gelu"]),
    "missing_field": (dict(hidden_size=_DELETE), ["hidden_size"]),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_raises_before_model_work(case, hf_checkpoint, tmp_path, no_model_work, header_only):
    _, path = hf_checkpoint("base", SEED, with_mtp=False)
    ck = _copy(path, tmp_path / "ck")
    changes, words = BAD_CONFIGS[case]
    _edit_config(ck, **changes)
    msg = _raises_fast(ConfigError, lambda: _llm(ck))
    for w in words:
        assert w in msg, f"{w!r} not in the error: {msg}"
    assert "config.json" in msg  # says where the problem is
    assert not no_model_work and header_only["opened"] == 0


def test_missing_config_json(hf_checkpoint, tmp_path, no_model_work):
    _, path = hf_checkpoint("base", SEED, with_mtp=False)
    ck = _copy(path, tmp_path / "ck")
    (ck / "config.json").unlink()
    msg = _raises_fast(ConfigError, lambda: _llm(ck))
    assert "config.json" in msg
    assert not no_model_work


def test_not_a_checkpoint_directory(tmp_path, no_model_work):
    msg = _raises_fast(ConfigError, lambda: _llm(tmp_path / "does-not-exist"))
    assert "does-not-exist" in msg


def test_num_spec_without_mtp_weights(hf_checkpoint, no_model_work, header_only):
    _, path = hf_checkpoint("base", SEED, with_mtp=False)
    msg = _raises_fast(ConfigError, lambda: _llm(path, num_spec=2))
    assert "mtp" in msg and "num_spec=0" in msg and "num_spec=2" in msg
    assert not no_model_work and header_only["get_tensor"] == 0


def test_num_spec_with_mtp_weights_loads(hf_checkpoint):
    _, path = hf_checkpoint("base", SEED, with_mtp=True)
    llm = _llm(path, num_spec=2)
    assert llm.model.mtp is not None
