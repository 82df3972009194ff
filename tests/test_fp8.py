"""FP8 checkpoints in the real fine-grained format (quantization_config quant_method "fp8",
weight_block_size, float8_e4m3fn `*.weight` with float32 `*.weight_scale_inv`,
modules_to_not_convert), made in the test from a tiny Qwen3-Next checkpoint:

- mtpkit dequantizes at load (CPU): its logits equal those of the dequantized twin (the same
  weights written as a plain checkpoint) within the dtype's tolerance, and those of
  transformers 5.24 loading the FP8 directory with FineGrainedFP8Config(dequantize=True);
- the CUDA path (plain linear layers keep FP8 weights and scales and run the block-scaled
  matmul), here through its torch reference: a layer in FP8 mode, and a whole model;
- inconsistent FP8 files are refused before any weight is read.
"""

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mtpkit import LLM
from mtpkit.attn.fp8_matmul import dequantize, fp8_linear_reference, quantize
from mtpkit.errors import CheckpointError, ConfigError
from mtpkit.models import loader
from mtpkit.models.layers import Linear, RowParallelLinear
from mtpkit.models.moe import SparseMoE

SEED = 3
# What real FP8 checkpoints keep unquantized (embeddings, lm_head, routers, the shared
# expert's gate, norms and the GDN's small per-head tensors are not linear weights at all).
NOT_CONVERTED = ["lm_head", "model.embed_tokens", "mlp.gate", "mlp.shared_expert_gate"]


def _quantizable(name: str, t: torch.Tensor) -> bool:
    return (name.endswith(".weight") and t.dim() == 2 and "norm" not in name and "conv1d" not in name
            and not any(name.startswith(m) or f".{m}." in f".{name}" for m in NOT_CONVERTED))


def make_fp8(src, fp8_dir, twin_dir, block):
    """Quantize `src` into `fp8_dir` (the real format) and write its dequantized weights (fp32,
    exact) as a plain checkpoint in `twin_dir`; loaded as bfloat16 it is the dequantized-bf16
    twin. The other tensors are bfloat16 in both. Returns the quantized names."""
    shutil.copytree(src, fp8_dir)
    shutil.copytree(src, twin_dir)
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    fp8, twin, quantized = {}, {}, []
    for name, t in tensors.items():
        if _quantizable(name, t):
            q, s = quantize(t.float(), block)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            twin[name] = dequantize(q, s, block, torch.float32)
            quantized.append(name)
        else:
            fp8[name] = t.to(torch.bfloat16)
            twin[name] = t.to(torch.bfloat16)
    save_file(fp8, str(fp8_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(twin, str(twin_dir / "model.safetensors"), metadata={"format": "pt"})
    for d, quant in ((fp8_dir, True), (twin_dir, False)):
        cfg = json.loads((d / "config.json").read_text())
        cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
        if quant:
            cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                          "weight_block_size": list(block),
                                          "modules_to_not_convert": NOT_CONVERTED}
        (d / "config.json").write_text(json.dumps(cfg, indent=2))
    return quantized


BLOCKS = {"block128": (128, 128), "block16x32": (16, 32)}


@pytest.fixture(scope="module")
def fp8_dirs(hf_checkpoint, tmp_path_factory):
    """Factory: block name -> (fp8 dir, twin dir, block, quantized names), made once each.
    [128, 128] is the real block (tiny matrices: one block, or a partial last one: the GDN
    in_proj has 192 rows); [16, 32] divides every tiny matrix into several whole blocks."""
    made = {}

    def get(name):
        if name not in made:
            _, src = hf_checkpoint("base", SEED, with_mtp=True)
            root = tmp_path_factory.mktemp("fp8")
            made[name] = (root / "fp8", root / "twin", BLOCKS[name],
                          make_fp8(src, root / "fp8", root / "twin", BLOCKS[name]))
        return made[name]
    return get


@pytest.fixture(params=list(BLOCKS))
def fp8_pair(request, fp8_dirs):
    return fp8_dirs(request.param)


PROMPT = [5, 17, 42, 99, 3, 200, 7, 64, 128, 1, 33, 250]


def _llm(path, **kw):
    return LLM(str(path), num_spec=1, max_num_seqs=2, max_model_len=64, enforce_eager=True, **kw)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fp8_logits_equal_dequantized_twin(fp8_pair, dtype):
    fp8_dir, twin_dir, _, names = fp8_pair
    assert any(".experts." in n for n in names) and any("self_attn" in n for n in names)
    got = _llm(fp8_dir, dtype=dtype).score(PROMPT)
    want = _llm(twin_dir, dtype=dtype).score(PROMPT)
    # Both load the same dequantized values (fp32 products rounded once to the dtype); two
    # separately built engines, so not asserted bitwise.
    tol = 2e-2 if dtype == "bfloat16" else 1e-5
    torch.testing.assert_close(got, want, atol=tol * want.abs().max().item(), rtol=0)


def test_fp8_matches_transformers_dequantize(fp8_dirs):
    """transformers 5.24 derives each tensor's block from its scale grid (rows // grid rows),
    which is the configured block only when every block is whole (as in real checkpoints,
    whose dims are multiples of 128): compared on the [16, 32] checkpoint, where they are."""
    transformers = pytest.importorskip("transformers")
    from transformers import FineGrainedFP8Config

    fp8_dir, _, _, _ = fp8_dirs("block16x32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(fp8_dir), quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.float32)
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0].float()
    got = _llm(fp8_dir, dtype="float32").score(PROMPT)
    torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max().item(), rtol=0)


def test_fp8_mode_linear_runs_block_scaled_matmul():
    """The CUDA path of a linear layer, on CPU through the kernel's torch reference: it keeps
    the FP8 weight and scales as stored and computes x @ dequant(W)^T with the activation
    quantized per token and group."""
    torch.manual_seed(0)
    block = (128, 128)
    w = torch.randn(200, 300)
    q, s = quantize(w, block)
    for layer in (Linear(300, 200), RowParallelLinear(300, 200)):
        layer.use_fp8(block)
        specs = layer.checkpoint_specs("m")
        tensors = {"m.weight": q, "m.weight_scale_inv": s}
        for spec in specs:
            assert set(spec.sources) <= set(tensors) and spec.keep_dtype
            spec.param.data = spec.assemble(tensors)
        assert layer.weight.dtype == torch.float8_e4m3fn and torch.equal(layer.weight_scale_inv, s)
        x = torch.randn(2, 3, 300)
        y = layer(x)
        assert y.shape == (2, 3, 200)
        torch.testing.assert_close(y, fp8_linear_reference(x, q, s, block))
        exact = x @ dequantize(q, s, block, torch.float32).t()
        # Only the activation's FP8 rounding (3 mantissa bits) separates them.
        assert (y - exact).abs().max() < 0.08 * exact.abs().max()


def test_fp8_kept_model_equals_dequantized(fp8_pair, monkeypatch):
    """A whole model with its plain linear layers kept in FP8 (what CUDA loads: raw weights
    and scales, sliced per layer) against the dequantized model. With the activation
    quantization made lossless the two compute the same products: equal to fp32 rounding.
    With it, only the activations' FP8 rounding (3 mantissa bits) separates them."""
    from mtpkit.attn import fp8_matmul

    fp8_dir, _, block, _ = fp8_pair
    want = _llm(fp8_dir, dtype="float32").score(PROMPT)
    kept = []
    orig_load, orig_keep = loader.load_checkpoint, loader.keep_fp8_linears
    monkeypatch.setattr(loader, "keep_fp8_linears", lambda *a: kept.extend(orig_keep(*a)) or kept)
    monkeypatch.setattr(loader, "load_checkpoint", lambda *a, **k: orig_load(*a, **k, keep_fp8=True))
    llm = _llm(fp8_dir, dtype="float32")
    assert "layers.3.self_attn.o_proj" in kept and "layers.0.linear_attn.out_proj" in kept
    assert llm.model.layers[3].self_attn.o_proj.weight.dtype == torch.float8_e4m3fn
    # the MoE keeps its experts in FP8 where the blocks divide them ([16, 32]: the tiny
    # intermediate 32 is whole blocks; [128, 128] is not, and is dequantized)
    moe = llm.model.layers[0].mlp
    assert (moe.w13.dtype == torch.float8_e4m3fn) == (block == (16, 32)) == ("layers.0.mlp" in kept)
    got = llm.score(PROMPT)
    assert (got - want).abs().max() < 0.2 * want.abs().max()
    with monkeypatch.context() as m:
        m.setattr(fp8_matmul, "quantize_activation",
                  lambda x, group: (x.float(), torch.ones(x.shape[0], -(-x.shape[1] // group))))
        # each of the MoE's three paths (fixed by the step's shape): dense, sparse, grouped
        for dense_limit, sparse_share in ((1 << 30, 8), (1 << 30, 0), (0, 8)):
            m.setattr(SparseMoE, "dense_limit", dense_limit)
            m.setattr(SparseMoE, "sparse_share", sparse_share)
            exact = llm.score(PROMPT)
            torch.testing.assert_close(exact, want, atol=1e-5 * want.abs().max().item(), rtol=0)


def test_inconsistent_fp8_checkpoints_are_refused(fp8_pair, tmp_path):
    fp8_dir, _, _, names = fp8_pair
    bad = tmp_path / "bad"
    shutil.copytree(fp8_dir, bad)
    f = bad / "model.safetensors"
    with safe_open(str(f), "pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    gone = names[0] + "_scale_inv"
    del tensors[gone]
    wrong = names[1] + "_scale_inv"
    tensors[wrong] = torch.ones(7, 7)
    save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as e:
        _llm(bad)
    msg = str(e.value)
    assert f"{names[0]} is float8_e4m3fn but {gone} is missing" in msg
    assert f"{wrong} has shape [7, 7]" in msg
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "gptq"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="quant_method='gptq' is not supported"):
        _llm(bad)


def test_ue8m0_scales(fp8_dirs, tmp_path, monkeypatch):
    """scale_fmt "ue8m0": power-of-two scales stored as float8_e8m0fnu, read as fp32 whether
    the weight is dequantized (CPU) or kept in FP8."""
    src, _, block, names = fp8_dirs("block16x32")
    d = tmp_path / "ue8m0"
    shutil.copytree(src, d)
    f = d / "model.safetensors"
    with safe_open(str(f), "pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    for n in names:
        w = dequantize(tensors[n], tensors[n + "_scale_inv"], block, torch.float32)
        s = torch.exp2(torch.ceil(torch.log2(tensors[n + "_scale_inv"])))
        tensors[n] = (w / s.repeat_interleave(block[0], 0)[:w.shape[0]].repeat_interleave(block[1], 1)[:, :w.shape[1]]
                      ).to(torch.float8_e4m3fn)
        tensors[n + "_scale_inv"] = s.to(torch.float8_e8m0fnu)
    save_file(tensors, str(f), metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["scale_fmt"] = "ue8m0"
    (d / "config.json").write_text(json.dumps(cfg))
    name = "model.layers.3.self_attn.o_proj.weight"
    want = dequantize(tensors[name], tensors[name + "_scale_inv"], block, torch.float32)
    llm = _llm(d, dtype="float32")
    assert torch.equal(llm.model.layers[3].self_attn.o_proj.weight, want)
    orig_load = loader.load_checkpoint
    monkeypatch.setattr(loader, "load_checkpoint", lambda *a, **k: orig_load(*a, **k, keep_fp8=True))
    kept = _llm(d, dtype="float32")
    o = kept.model.layers[3].self_attn.o_proj
    assert o.weight_scale_inv.dtype == torch.float32
    assert torch.equal(o.weight_scale_inv, tensors[name + "_scale_inv"].float())
    assert kept.model.layers[0].mlp.w13_scale.dtype == torch.float32
    from mtpkit.attn import fp8_matmul
    want = llm.score(PROMPT)
    monkeypatch.setattr(fp8_matmul, "quantize_activation",  # lossless: the weights' products alone
                        lambda x, group: (x.float(), torch.ones(x.shape[0], -(-x.shape[1] // group))))
    torch.testing.assert_close(kept.score(PROMPT), want, atol=1e-5 * want.abs().max().item(), rtol=0)


def test_fp8_column_shards_take_their_scale_blocks():
    """Under tensor parallelism a rank's FP8 slice is whole scale blocks with those blocks'
    scales; a split through a block is not kept in FP8 (the loader dequantizes it)."""
    from mtpkit.models.layers import ColumnParallelLinear
    from mtpkit.parallel import TP

    torch.manual_seed(1)
    block = (16, 32)
    w = torch.randn(64, 96)
    q, s = quantize(w, block)
    x = torch.randn(3, 96)
    full = fp8_linear_reference(x, q, s, block)
    parts = []
    for rank in (0, 1):
        layer = ColumnParallelLinear(96, 64, TP(rank=rank, size=2))
        assert layer.fp8_shardable(block)
        layer.use_fp8(block)
        for spec in layer.checkpoint_specs("m"):
            spec.param.data = spec.assemble({"m.weight": q, "m.weight_scale_inv": s})
        assert torch.equal(layer.weight_scale_inv, s[rank * 2:(rank + 1) * 2])
        parts.append(layer(x))
    torch.testing.assert_close(torch.cat(parts, dim=-1), full)
    assert not ColumnParallelLinear(96, 48, TP(rank=1, size=2)).fp8_shardable(block)   # 24-row halves
