"""The benchmark's llama.cpp baseline (benchmarks/llamacpp): its driver, fed one held-out
prompt as token ids, greedy-decodes exactly mtpkit's tokens, plain and with MTP drafts
(tiny-qwen3-next's MTP head; tiny-gemma4's assistant). Runs when llama.cpp is built
(benchmarks/llamacpp/build.py, into $MTPKIT_LLAMACPP or ~/.cache/mtpkit-llamacpp) and skips
saying how to build it otherwise: building takes 15-35 minutes, too long for the suite."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "llamacpp"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import llamacpp_client as lc  # noqa: E402

MAX_TOKENS = 32
WORKDIR = lc.workdir_from_env()


@pytest.mark.parametrize("model", ["tiny-qwen3-next", "tiny-gemma4"])
def test_driver_greedy_tokens_equal_mtpkits(model):
    why = lc.missing(WORKDIR, model)
    if why:
        pytest.skip(why)
    from bench_cpu import heldout_prompts
    prompt = heldout_prompts(1, 64)[0]
    want, = lc.mtpkit_greedy(model, [prompt], MAX_TOKENS)
    files = lc.model_files(WORKDIR, model)
    for mode in ("plain", "mtp"):
        with lc.LlamaCppDriver(lc.driver_path(WORKDIR), *files, mode=mode) as d:
            first = d.generate(prompt, MAX_TOKENS)
            again = d.generate(prompt, MAX_TOKENS)   # the second request starts from a clean state
        assert first.tokens == want, (mode, first.tokens, want)
        assert again.tokens == want, (mode, again.tokens, want)
        assert len(first.tokens) == MAX_TOKENS
        if mode == "mtp":   # drafts were made and some accepted: fewer target forwards than tokens
            assert first.n_drafted > 0 and first.n_accepted > 0 and first.n_steps < MAX_TOKENS, first
        else:
            assert first.n_drafted == 0 and first.n_steps == MAX_TOKENS, first


def test_missing_build_says_how_to_build(tmp_path):
    why = lc.missing(tmp_path, "tiny-qwen3-next")
    assert why is not None and lc.BUILD_COMMAND in why and str(tmp_path) in why
