"""benchmarks/bf16_divergence.py (issue 31, item 9) in a short run: fp32 with drafts equals fp32
without (the control the README's "exact in float32" rests on), and the divergence finder reports
a planted divergence where it is, with the margin there."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bf16_divergence as bd  # noqa: E402


def test_short_run_fp32_is_identical(capsys):
    assert bd.main(["--models", "tiny-qwen3-next", "--prompts", "2", "--tokens", "12", "--specs", "2"]) == 0
    out = capsys.readouterr().out
    assert "tiny-qwen3-next  float32   num_spec=2: 0/2 prompts diverge" in out, out


def test_compare_finds_the_first_divergence_and_its_margin():
    llm, ref, _ = bd.run("tiny-qwen3-next", 0, "float32", [[10, 20, 30, 40]], 6)
    other = [ref[0][:3] + [(ref[0][3] + 1) % 257] + ref[0][4:]]
    (i, j, margin), = bd.compare(llm, [[10, 20, 30, 40]], ref, other)
    top = torch.topk(llm.score([10, 20, 30, 40] + ref[0][:3])[-1], 2).values
    assert (i, j) == (0, 3) and abs(margin - float(top[0] - top[1])) < 1e-6
