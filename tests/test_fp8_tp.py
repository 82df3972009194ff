"""FP8 weights kept under tensor parallelism on CPU: two gloo processes (one
`accelerate.debug_launcher` job, as tests/test_tp.py) load FP8 checkpoints with keep_fp8=True,
and their logits are checked against the single-process dequantized twin (tests/test_fp8.py
makes both).

At the tiny widths the ranks' shards cut the [128, 128] blocks everywhere (Qwen3-Next: o_proj
and the shared expert's down projection split their input columns inside a block, the qkv and
shared gate/up rows name their scale rows; Gemma 4: the MLP's 48-column halves of a 32-column
block at [16, 32]), so both the widened columns and the named scale rows run under TP. With
the activation quantization made lossless every path (dense, sparse, grouped MoE) equals the
twin to fp32 rounding; with it, the ranks quantize their own shards (rank-local amax), which
only the activations' FP8 rounding separates from the twin.
"""

from pathlib import Path

import pytest
import torch

import gemma4_oracle as G
from mtpkit import LLM
from test_fp8 import GEMMA_PROMPT, PROMPT, _error, _moe_paths, lossless_activations, make_fp8

# accelerate's launchers meet on a fixed port: this file takes turns with the others that start them (conftest)
pytestmark = pytest.mark.fixed_port

CASES = {  # name -> (model, block, prompt)
    "qwen-128": ("qwen", (128, 128), PROMPT),
    "qwen-16x32": ("qwen", (16, 32), PROMPT),
    "gemma-moe-16x32": ("moe", (16, 32), GEMMA_PROMPT),
    "gemma-dense-128": ("dense", (128, 128), GEMMA_PROMPT),
}


def _llm(path, **kw):
    return LLM(str(path), num_spec=0, max_num_seqs=2, max_model_len=64, enforce_eager=True, dtype="float32",
               device="cpu", **kw)


class _Patch:
    """monkeypatch's setattr outside pytest (a forked rank)."""

    def __init__(self):
        self.undo = []

    def setattr(self, obj, name, value):
        self.undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def close(self):
        for obj, name, value in reversed(self.undo):
            setattr(obj, name, value)


def _tp2_worker(root: str):
    from accelerate import PartialState

    from mtpkit.layers.fp8_layout import FP8Matrix
    from mtpkit.models.gemma4.model import Gemma4Experts
    from mtpkit.layers.moe import SparseMoE
    PartialState._reset_state()
    state = PartialState(cpu=True)
    torch.set_num_threads(1)
    out = {}
    for name, (model, _, prompt) in CASES.items():
        llm = _llm(Path(root) / name / "fp8", keep_fp8=True)
        mats = [m for m in llm.model.modules() if isinstance(m, FP8Matrix)]
        rec = dict(tp=llm.tp.size, real=llm.score(prompt), lossless=[],
                   indexed=sum(m.scale_rows is not None for m in mats), widened=sum(any(m.k_pad) for m in mats),
                   fp8=sum(p.numel() for p in llm.model.parameters() if p.dtype == torch.float8_e4m3fn))
        patch = _Patch()
        with lossless_activations():
            for _ in _moe_paths(patch, Gemma4Experts if model != "qwen" else SparseMoE):
                rec["lossless"].append(llm.score(prompt))
        patch.close()
        out[name] = rec
    torch.save(out, Path(root) / f"rank{state.process_index}.pt")


@pytest.fixture(scope="module")
def dirs(hf_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8tp")
    for name, (model, block, _) in CASES.items():
        if model == "qwen":
            src = hf_checkpoint("base", 3, with_mtp=True)[1]
        else:
            src = root / f"src-{model}"
            if not src.exists():
                G.save(G.build_hf(model), src)
        make_fp8(src, root / name / "fp8", root / name / "twin", block)
    return root


@pytest.fixture(scope="module")
def tp2(dirs):
    from accelerate import debug_launcher
    debug_launcher(_tp2_worker, args=(str(dirs),), num_processes=2)
    return [torch.load(dirs / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("name", list(CASES))
def test_tp2_kept_fp8_equals_dequantized_twin(dirs, tp2, name):
    want = _llm(dirs / name / "twin").score(CASES[name][2])
    r0, r1 = tp2[0][name], tp2[1][name]
    assert r0["tp"] == r1["tp"] == 2
    assert r0["fp8"] > 0 and r1["fp8"] > 0
    assert torch.equal(r0["real"], r1["real"]), "every rank holds the same gathered logits"
    assert _error(r0["real"], want) < 0.5
    assert len(r0["lossless"]) == 3
    for got in r0["lossless"]:  # dense, sparse, grouped MoE paths
        torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=0)


def test_tp2_shards_cut_blocks(tp2):
    """The cases exercise what TP adds: shards whose columns are widened to whole blocks, and
    (at [128, 128]) rows naming their scale rows."""
    for r in tp2:
        assert r["qwen-128"]["widened"] > 0 and r["qwen-128"]["indexed"] > 0
        assert r["qwen-16x32"]["widened"] > 0 and r["gemma-moe-16x32"]["widened"] > 0
        assert r["gemma-dense-128"]["indexed"] > 0
