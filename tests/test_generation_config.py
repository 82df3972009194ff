"""generation_config.json: eos ids (a list), and sampling defaults when a call passes no
SamplingParams; the tokenizer files' eos token."""

import json

import pytest

from mtpkit import LLM, SamplingParams
from mtpkit.errors import CheckpointError
from mtpkit.checkpoint.hub import ASSETS

TINY = ASSETS / "tiny-qwen3-next"
PROMPT = "def fibonacci(n):"


def _checkpoint(tmp_path, generation_config: dict | None = None, tokenizer_config: dict | None = None):
    d = tmp_path / "ckpt"
    d.mkdir()
    for p in TINY.iterdir():
        if p.name not in ("README.md", "generation_config.json"):
            (d / p.name).symlink_to(p)
    if generation_config is not None:
        (d / "generation_config.json").write_text(json.dumps(generation_config))
    if tokenizer_config is not None:
        (d / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return d


@pytest.fixture(scope="module")
def reference():
    """Greedy tokens of PROMPT without any eos (the embedded model's own)."""
    llm = LLM("tiny-qwen3-next", max_model_len=64)
    return llm, llm.generate(PROMPT, SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids


def test_eos_list_from_generation_config_stops_generation(tmp_path, reference):
    ref_llm, ref = reference
    # an eos id the greedy output reaches after a few tokens, not at once
    k = next(i for i in range(3, len(ref)) if ref[i] not in ref[:i])
    d = _checkpoint(tmp_path, {"eos_token_id": [256, ref[k]], "do_sample": False, "temperature": 0.6})
    llm = LLM(str(d), num_spec=2, max_model_len=64)
    assert llm.eos_token_ids == tuple(sorted((ref[k], 256)))
    out = llm.generate(PROMPT, SamplingParams(max_tokens=24))[0]
    assert out.finish_reason == "stop" and out.token_ids == ref[:k + 1]
    # do_sample false: no SamplingParams means greedy, whatever temperature the file gives
    req = llm.add_request(PROMPT)
    assert req.params.temperature == 0.0
    llm.abort(req.req_id)


def test_sampling_defaults_apply_without_sampling_params(tmp_path):
    d = _checkpoint(tmp_path, {"eos_token_id": [256], "do_sample": True, "temperature": 0.7, "top_k": 20,
                               "top_p": 0.8})
    llm = LLM(str(d), max_model_len=64)
    req = llm.add_request(PROMPT)
    assert (req.params.temperature, req.params.top_k, req.params.top_p) == (0.7, 20, 0.8)
    assert req.seed is not None                      # a random request
    explicit = llm.add_request(PROMPT, SamplingParams(max_tokens=4))
    assert (explicit.params.temperature, explicit.params.top_k, explicit.params.top_p) == (0.0, 0, 1.0)
    llm.abort([req.req_id, explicit.req_id])
    [out] = llm.generate(PROMPT)
    assert out.finish_reason in ("length", "stop")
    # a Gemma-style file: top_k and top_p without a temperature sample at temperature 1
    (tmp_path / "g").mkdir()
    d = _checkpoint(tmp_path / "g", {"do_sample": True, "top_k": 64, "top_p": 0.95})
    req = LLM(str(d), max_model_len=64).add_request(PROMPT)
    assert (req.params.temperature, req.params.top_k, req.params.top_p) == (1.0, 64, 0.95)


def test_eos_token_of_the_tokenizer_files(tmp_path):
    # a chat checkpoint names its end-of-turn token in tokenizer_config.json
    d = _checkpoint(tmp_path, {}, {"eos_token": {"content": "<|endoftext|>", "special": True}})
    (d / "config.json").unlink()
    cfg = json.loads((TINY / "config.json").read_text())
    cfg["eos_token_id"] = None
    (d / "config.json").write_text(json.dumps(cfg))
    assert LLM(str(d), max_model_len=64).eos_token_ids == (256,)


def test_bad_generation_config_is_named(tmp_path):
    d = _checkpoint(tmp_path, {"eos_token_id": ["</s>"]})
    with pytest.raises(CheckpointError, match="generation_config.json: eos_token_id"):
        LLM(str(d))
    (d / "generation_config.json").write_text(json.dumps({"do_sample": True, "top_p": 2.0}))
    with pytest.raises(CheckpointError, match="generation_config.json.*top_p"):
        LLM(str(d))
