"""Every config.json field a family reads is checked for type and range before use, all problems
in one ConfigError (issue 31, item 4): both families and the Gemma 4 assistant."""

import ast
import copy
import json
from pathlib import Path

import pytest

from mtpkit import ConfigError, LLM
from mtpkit.checkpoint.hub import resolve_model
from mtpkit.models.gemma4 import assistant_config, config as gemma4_config
from mtpkit.models.qwen3_next import config as qwen_config

ROOT = Path(__file__).resolve().parents[1] / "mtpkit"
QWEN = json.loads((resolve_model("tiny-qwen3-next") / "config.json").read_text())
GEMMA = json.loads((resolve_model("tiny-gemma4") / "config.json").read_text())
ASSISTANT = json.loads((resolve_model("tiny-gemma4-assistant") / "config.json").read_text())


def _with(raw, **changes):
    raw = copy.deepcopy(raw)
    raw.update(changes)
    return raw


def _error(cls, raw) -> str:
    with pytest.raises(ConfigError) as e:
        cls.from_dict(raw, where="config.json")
    return str(e.value)


@pytest.mark.parametrize("change, words", [
    ({"num_attention_heads": -4}, "num_attention_heads=-4 must be >= 1"),      # was a RuntimeError from torch
    ({"eos_token_id": 9999}, "eos_token_id=9999: [9999] outside the vocabulary 0..256"),
    ({"hidden_size": "256"}, "hidden_size='256' must be an integer"),
    ({"rms_norm_eps": 0}, "rms_norm_eps=0 must be > 0"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings='yes' must be true or false"),
    ({"mlp_only_layers": [0, -1]}, "every entry of mlp_only_layers must be >= 0"),
    ({"linear_conv_kernel_dim": 1.5}, "linear_conv_kernel_dim=1.5 must be an integer"),
])
def test_qwen3_next_field_types_and_ranges(change, words):
    assert words in _error(qwen_config.Qwen3NextConfig, _with(QWEN, **change))


@pytest.mark.parametrize("change, words", [
    ({"num_attention_heads": -4}, "num_attention_heads=-4 must be >= 1"),
    ({"eos_token_id": [1, 9999]}, "[9999] outside the vocabulary"),
    ({"hidden_size": "256"}, "hidden_size='256' must be an integer"),
    ({"sliding_window": 0}, "sliding_window=0 must be >= 1"),
    ({"final_logit_softcapping": -1.0}, "final_logit_softcapping=-1.0 must be > 0"),
])
def test_gemma4_field_types_and_ranges(change, words):
    assert words in _error(gemma4_config.Gemma4Config, _with(GEMMA, **change))


def test_assistant_fields_and_its_decoders():
    assert "backbone_hidden_size='x' must be an integer" in _error(
        assistant_config.Gemma4AssistantConfig, _with(ASSISTANT, backbone_hidden_size="x"))
    bad_text = _with(ASSISTANT, text_config=_with(ASSISTANT["text_config"], num_attention_heads=0))
    assert "num_attention_heads=0 must be >= 1" in _error(assistant_config.Gemma4AssistantConfig, bad_text)


def test_every_problem_in_one_error():
    msg = _error(qwen_config.Qwen3NextConfig, _with(QWEN, num_attention_heads=-4, eos_token_id=9999,
                                                    hidden_size="256"))
    assert "3 problems" in msg and all(w in msg for w in ("num_attention_heads", "eos_token_id", "hidden_size"))
    msg = _error(qwen_config.Qwen3NextConfig, _with(QWEN, num_key_value_heads=3, linear_num_key_heads=3))
    assert "2 problems" in msg and "num_key_value_heads=3" in msg and "linear_num_key_heads=3" in msg


def test_llm_refuses_before_any_weight(tmp_path, monkeypatch):
    import mtpkit.checkpoint.loader as loader
    monkeypatch.setattr(loader, "load_checkpoint", lambda *a, **k: pytest.fail("weights were read"))
    d = tmp_path / "m"
    d.mkdir()
    for f in resolve_model("tiny-qwen3-next").iterdir():
        (d / f.name).symlink_to(f)
    (d / "config.json").unlink()
    (d / "config.json").write_text(json.dumps(_with(QWEN, num_attention_heads=-4)))
    with pytest.raises(ConfigError, match="num_attention_heads=-4"):
        LLM(d)


def _keys_read(path: Path) -> set[str]:
    """Keys from_dict reads from `raw` / `text` (raw["x"], raw.get("x"), text.get("x"))."""
    tree = ast.parse(path.read_text())
    keys = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "raw" \
                and isinstance(node.slice, ast.Constant):
            keys.add(node.slice.value)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "raw" and node.args \
                and isinstance(node.args[0], ast.Constant):
            keys.add(node.args[0].value)
    return keys


@pytest.mark.parametrize("module", [qwen_config, gemma4_config, assistant_config])
def test_every_field_read_is_declared(module):
    undeclared = _keys_read(Path(module.__file__)) - set(module.FIELDS)
    assert not undeclared, f"{module.__name__} reads {sorted(undeclared)} without a Field in FIELDS"
