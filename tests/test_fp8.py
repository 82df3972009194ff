"""FP8 checkpoints in the real fine-grained format (quantization_config quant_method "fp8",
weight_block_size, float8_e4m3fn `*.weight` with float32 `*.weight_scale_inv`,
modules_to_not_convert), made in the test from tiny Qwen3-Next and Gemma 4 checkpoints, each
beside its dequantized twin (the same weights, dequantized, as a plain checkpoint):

- dequantized at load (the CPU default): logits equal the twin's within the dtype's tolerance,
  and those of transformers 5.24 loading the FP8 directory with FineGrainedFP8Config(dequantize=True);
- kept in FP8 (`keep_fp8=True`, the CUDA default; here through the kernel's torch reference):
  every FP8 tensor of the checkpoint stays FP8 (the model holds exactly the checkpoint's FP8
  elements), through every merged layout (Qwen3-Next's attention qkv and GDN in_proj, the MoE
  router + shared-expert rows with the router unquantized or quantized, experts stored one by one and fused;
  Gemma 4's qkv, MLP and fused experts), in both row layouts (whole blocks at [16, 32]; rows
  naming their scale rows at [128, 128], where the tiny parts cut blocks). With the activation
  quantization made lossless the kept model computes the twin's products: equal within fp32 /
  bf16 rounding on each MoE path; with it, within the activations' FP8 rounding;
- a layer's tensor-parallel shards that cut scale blocks (rows naming their scales, input
  columns widened to whole blocks) compute the whole layer's product (tests/test_fp8_tp.py runs
  whole models under TP=2);
- inconsistent FP8 files are refused before any weight is read.
"""

import contextlib
import json
import os
import shutil
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mtpkit import LLM, SamplingParams
from mtpkit.kernels import fp8_matmul
from mtpkit.kernels.fp8_matmul import dequantize, fp8_linear, quantize
from mtpkit.errors import CheckpointError, ConfigError
from mtpkit.layers.fp8_layout import FP8Matrix, PlainRows, row_layout, row_sources
from mtpkit.layers.linear import ColumnParallelLinear, Linear, MergedColumnParallelLinear, RowParallelLinear
from mtpkit.layers.moe import SparseMoE
from mtpkit.parallel import TP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gemma4_oracle as G  # noqa: E402

SEED = 3
# What real FP8 checkpoints keep unquantized (embeddings, lm_head, routers, the shared
# expert's gate, norms and the GDN's small per-head tensors are not linear weights at all).
NOT_CONVERTED = ["lm_head", "model.embed_tokens", "mlp.gate", "mlp.shared_expert_gate"]
FUSED = (".experts.gate_up_proj", ".experts.down_proj")


def _quantizable(name: str, t: torch.Tensor, not_converted=NOT_CONVERTED) -> bool:
    fused = name.endswith(FUSED) and t.dim() == 3
    return ((name.endswith(".weight") and t.dim() == 2 or fused) and "norm" not in name and "conv1d" not in name
            and "embed" not in name
            and not any(name.startswith(m) or f".{m}." in f".{name}" for m in not_converted))


def _tensors(d):
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _write(d, tensors, block, not_converted=NOT_CONVERTED):
    """model.safetensors, and config.json as bf16 with (block given) the FP8 quantization_config."""
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    if isinstance(cfg.get("text_config"), dict):
        cfg["text_config"]["dtype"] = "bfloat16"
    if block is not None:
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                      "weight_block_size": list(block), "modules_to_not_convert": not_converted}
    (d / "config.json").write_text(json.dumps(cfg, indent=2))


def make_fp8(src, fp8_dir, twin_dir, block, fuse_experts=False, not_converted=NOT_CONVERTED):
    """Quantize `src` into `fp8_dir` (the real format) and write its dequantized weights (fp32,
    exact) as a plain checkpoint in `twin_dir`; loaded as bfloat16 it is the dequantized-bf16
    twin. The other tensors are bfloat16 in both. `fuse_experts`: Qwen3-Next's per-expert
    tensors written fused in the FP8 directory (experts.gate_up_proj [E, 2I, H], down_proj
    [E, H, I], quantized as such); the twin keeps them per expert. Returns the quantized names."""
    shutil.copytree(src, fp8_dir)
    shutil.copytree(src, twin_dir)
    tensors = _tensors(src)
    if fuse_experts:
        tensors = _fused(tensors)
    fp8, twin, quantized = {}, {}, []
    for name, t in tensors.items():
        if _quantizable(name, t, not_converted):
            q, s = quantize(t.float(), block)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            twin[name] = dequantize(q, s, block, torch.float32)
            quantized.append(name)
        else:
            fp8[name] = t.to(torch.bfloat16)
            twin[name] = t.to(torch.bfloat16)
    _write(fp8_dir, fp8, block, not_converted)
    _write(twin_dir, _split(twin) if fuse_experts else twin, None)
    return quantized


def _fused(tensors):
    out, experts = {}, {}
    for name, t in tensors.items():
        head, sep, tail = name.partition(".experts.")
        if sep and not tail.startswith(("gate_up_proj", "down_proj")):
            e, proj = tail.split(".")[:2]
            experts.setdefault(head, {}).setdefault(int(e), {})[proj] = t
        else:
            out[name] = t
    for head, by_e in experts.items():
        es = [by_e[e] for e in sorted(by_e)]
        out[head + ".experts.gate_up_proj"] = torch.stack([torch.cat([x["gate_proj"], x["up_proj"]]) for x in es])
        out[head + ".experts.down_proj"] = torch.stack([x["down_proj"] for x in es])
    return out


def _split(tensors):
    out = {}
    for name, t in tensors.items():
        if name.endswith(FUSED):
            head = name.rpartition(".")[0]
            for e, w in enumerate(t):
                if name.endswith("gate_up_proj"):
                    g, u = w.chunk(2)
                    out[f"{head}.{e}.gate_proj.weight"], out[f"{head}.{e}.up_proj.weight"] = g, u
                else:
                    out[f"{head}.{e}.down_proj.weight"] = w
        else:
            out[name] = t
    return out


BLOCKS = {"block128": (128, 128), "block16x32": (16, 32)}


@pytest.fixture(scope="module")
def fp8_dirs(hf_checkpoint, tmp_path_factory):
    """Factory: (model, block name, fused) -> (fp8 dir, twin dir, block, quantized names), made
    once each. Models: Qwen3-Next "base" (with its MTP head), Gemma 4 "dense" and "moe".
    [128, 128] is the real block (tiny matrices: one block, or a partial one: parts and
    permutations cut blocks); [16, 32] divides every tiny matrix into whole blocks."""
    made, gemma = {}, {}

    def get(model, name, fused=False):
        key = (model, name, fused)
        if key not in made:
            if model == "qwen":
                src = hf_checkpoint("base", SEED, with_mtp=True)[1]
            else:
                if model not in gemma:
                    gemma[model] = tmp_path_factory.mktemp(f"gemma-{model}") / "src"
                    G.save(G.build_hf(model), gemma[model])
                src = gemma[model]
            root = tmp_path_factory.mktemp("fp8")
            made[key] = (root / "fp8", root / "twin", BLOCKS[name],
                         make_fp8(src, root / "fp8", root / "twin", BLOCKS[name], fuse_experts=fused))
        return made[key]
    return get


@pytest.fixture(params=list(BLOCKS))
def fp8_pair(request, fp8_dirs):
    return fp8_dirs("qwen", request.param)


PROMPT = [5, 17, 42, 99, 3, 200, 7, 64, 128, 1, 33, 250]
GEMMA_PROMPT = [p % 128 for p in PROMPT]


def _llm(path, **kw):
    return LLM(str(path), num_spec=kw.pop("num_spec", 1), max_num_seqs=2, max_model_len=64,
               enforce_eager=kw.pop("enforce_eager", True), **kw)


@contextlib.contextmanager
def lossless_activations():
    """The activation quantization made exact (x as fp32, scales 1): a kept model then computes
    exactly the products of the weights as stored, so it must match the dequantized twin."""
    orig = fp8_matmul.quantize_activation
    fp8_matmul.quantize_activation = lambda x, group: (x.float(), torch.ones(x.shape[0], -(-x.shape[1] // group)))
    try:
        yield
    finally:
        fp8_matmul.quantize_activation = orig


def _moe_paths(monkeypatch, moe_cls=SparseMoE):
    """Each of the MoE's three paths in turn (fixed by the step's shape): dense, sparse, grouped."""
    for dense_limit, sparse_share in ((1 << 30, 8), (1 << 30, 0), (0, 8)):
        monkeypatch.setattr(moe_cls, "dense_limit", dense_limit)
        monkeypatch.setattr(moe_cls, "sparse_share", sparse_share)
        yield


def _fp8_elements(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.dtype == torch.float8_e4m3fn)


def _checkpoint_fp8_elements(d, skip=()) -> int:
    return sum(t.numel() for n, t in _tensors(d).items() if t.dtype == torch.float8_e4m3fn
               and not n.startswith(skip))


def _close(got, want, dtype):
    tol = {"float32": 1e-5, "bfloat16": 2e-2}[dtype]
    torch.testing.assert_close(got, want, atol=tol * want.abs().max().item(), rtol=0)


def _error(got, exact) -> float:
    return ((got - exact).abs().max() / exact.abs().max()).item()


# ---- dequantized at load (the CPU default) ---------------------------------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fp8_logits_equal_dequantized_twin(fp8_pair, dtype):
    fp8_dir, twin_dir, _, names = fp8_pair
    assert any(".experts." in n for n in names) and any("self_attn" in n for n in names)
    llm = _llm(fp8_dir, dtype=dtype)
    assert _fp8_elements(llm.model) == 0
    # Both load the same dequantized values (fp32 products rounded once to the dtype); two
    # separately built engines, so not asserted bitwise.
    _close(llm.score(PROMPT), _llm(twin_dir, dtype=dtype).score(PROMPT), dtype)


def test_fp8_matches_transformers_dequantize(fp8_dirs):
    """transformers 5.24 derives each tensor's block from its scale grid (rows // grid rows),
    which is the configured block only when every block is whole (as in real checkpoints,
    whose dims are multiples of 128): compared on the [16, 32] checkpoint, where they are."""
    transformers = pytest.importorskip("transformers")
    from transformers import FineGrainedFP8Config

    fp8_dir, _, _, _ = fp8_dirs("qwen", "block16x32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(fp8_dir), quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.float32)
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0].float()
    got = _llm(fp8_dir, dtype="float32").score(PROMPT)
    torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max().item(), rtol=0)


# ---- kept in FP8 ------------------------------------------------------------------------


def _segments(module):
    return [type(s).__name__ for s in module.segments]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kept_fp8_qwen3_next_equals_dequantized_twin(fp8_pair, dtype, monkeypatch):
    """fp32: equal to the twin's logits to fp32 rounding. bf16: the kept model rounds at other
    points than the twin (fp32 products rounded once per FP8 matmul, the experts' sum in
    fp32), so it is held to bf16's own error: as close to the fp32 twin as the bf16 twin is."""
    fp8_dir, twin_dir, block, _ = fp8_pair
    want = _llm(twin_dir, dtype="float32").score(PROMPT)
    bf16_error = _error(_llm(twin_dir, dtype="bfloat16").score(PROMPT), want)
    llm = _llm(fp8_dir, dtype=dtype, keep_fp8=True)
    m = llm.model
    # every FP8 tensor of the checkpoint is held as stored (TP=1: no widened columns)
    assert _fp8_elements(m) == _checkpoint_fp8_elements(fp8_dir) > 0
    attn, gdn, moe = m.layers[3].self_attn, m.layers[0].linear_attn, m.layers[0].mlp
    assert _segments(attn.qkv_proj.fp8) == _segments(gdn.in_proj.fp8) == ["FP8Matrix"]
    assert attn.o_proj.fp8 is not None and m.mtp.fc.fp8 is not None and m.mtp.layers[0].mlp.fp8 is not None
    # the router and the shared expert's gate stay as stored (bf16), its gate and up rows FP8
    assert _segments(moe.fp8_in) == ["PlainRows", "FP8Matrix"]
    assert moe.w13 is None and moe.fp8.w13.weight.dtype == torch.float8_e4m3fn
    indexed = [n for n, x in m.named_modules() if isinstance(x, FP8Matrix) and x.scale_rows is not None]
    if block == (16, 32):  # whole blocks everywhere but in_proj_ba (8 rows): the block layout
        assert indexed == []
    else:  # q/k/gate rows of one head, the GDN's interleaved groups, gate + up: rows name their scales
        assert {"layers.3.self_attn.qkv_proj.fp8.segments.0", "layers.0.linear_attn.in_proj.fp8.segments.0",
                "layers.0.mlp.fp8.w13"} <= set(indexed)
    # With the activations' FP8 rounding (3 mantissa bits) only: the tiny models' per-token
    # groups span whole rows, so this is loose; the exact comparison follows.
    assert _error(llm.score(PROMPT), want) < 0.5
    with lossless_activations():
        for _ in _moe_paths(monkeypatch):
            got = llm.score(PROMPT)
            if dtype == "float32":
                _close(got, want, dtype)
            else:
                assert _error(got, want) <= 1.5 * bf16_error


def test_kept_fp8_router_and_shared_gate_quantized_too(hf_checkpoint, tmp_path, monkeypatch):
    """A checkpoint that quantizes the router and the shared expert's 1-row gate as well: w_in
    is one FP8 run whose parts (4 + 1 + 32 + 32 rows at block 16) cut blocks, so its rows name
    their scale rows."""
    src = hf_checkpoint("base", SEED, with_mtp=True)[1]
    keep = ["lm_head", "model.embed_tokens"]
    make_fp8(src, tmp_path / "fp8", tmp_path / "twin", (16, 32), not_converted=keep)
    want = _llm(tmp_path / "twin", dtype="float32").score(PROMPT)
    llm = _llm(tmp_path / "fp8", dtype="float32", keep_fp8=True)
    assert _fp8_elements(llm.model) == _checkpoint_fp8_elements(tmp_path / "fp8")
    moe = llm.model.layers[0].mlp
    assert _segments(moe.fp8_in) == ["FP8Matrix"] and moe.fp8_in.segments[0].scale_rows is not None
    with lossless_activations():
        for _ in _moe_paths(monkeypatch):
            _close(llm.score(PROMPT), want, "float32")


def test_kept_fp8_fused_experts(fp8_dirs, monkeypatch):
    """A checkpoint whose experts are stored fused (experts.gate_up_proj with one scale grid
    over the gate and up rows) keeps them as stored, and dequantizes to the same model."""
    fp8_dir, twin_dir, _, names = fp8_dirs("qwen", "block128", fused=True)
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    want = _llm(twin_dir, dtype="float32").score(PROMPT)
    _close(_llm(fp8_dir, dtype="float32").score(PROMPT), want, "float32")
    llm = _llm(fp8_dir, dtype="float32", keep_fp8=True)
    assert _fp8_elements(llm.model) == _checkpoint_fp8_elements(fp8_dir)
    assert llm.model.layers[0].mlp.fp8.w13.scale_rows is None   # the fused grid is the block layout
    with lossless_activations():
        for _ in _moe_paths(monkeypatch):
            _close(llm.score(PROMPT), want, "float32")


@pytest.mark.parametrize("name", ["dense", "moe"])
@pytest.mark.parametrize("block", list(BLOCKS))
def test_kept_fp8_gemma4_equals_dequantized_twin(fp8_dirs, name, block, monkeypatch):
    from mtpkit.models.gemma4.model import Gemma4Experts

    fp8_dir, twin_dir, _, names = fp8_dirs(name, block)
    kw = dict(dtype="float32", num_spec=0)
    want = _llm(twin_dir, **kw).score(GEMMA_PROMPT)
    _close(_llm(fp8_dir, **kw).score(GEMMA_PROMPT), want, "float32")
    llm = _llm(fp8_dir, keep_fp8=True, **kw)
    assert _fp8_elements(llm.model) == _checkpoint_fp8_elements(fp8_dir)
    layer = llm.model.layers[0]
    assert layer.self_attn.qkv_proj.fp8 is not None and layer.mlp.gate_up_proj.fp8 is not None
    if name == "moe":
        assert any(n.endswith("router.proj.weight") for n in names)
        assert _segments(layer.experts.fp8_in) == ["FP8Matrix"] and layer.experts.fp8 is not None
    assert _error(llm.score(GEMMA_PROMPT), want) < 0.5
    with lossless_activations():
        for _ in _moe_paths(monkeypatch, Gemma4Experts):
            _close(llm.score(GEMMA_PROMPT), want, "float32")


def test_kept_fp8_traced_graphs_equal_eager(fp8_dirs):
    """The CPU graph path (TorchScript traces of the verify step and the MTP proposal) over
    kept FP8 weights: the same tokens as eager."""
    fp8_dir, _, _, _ = fp8_dirs("qwen", "block128")
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    prompts = [PROMPT, PROMPT[:5]]
    eager = [o.token_ids for o in _llm(fp8_dir, dtype="float32", keep_fp8=True).generate(prompts, params)]
    graphs = _llm(fp8_dir, dtype="float32", keep_fp8=True, enforce_eager=False)
    assert graphs.runner.graphs is not None
    assert [o.token_ids for o in graphs.generate(prompts, params)] == eager


def test_fp8_matmuls_are_chosen_by_ops(fp8_dirs, monkeypatch):
    """The FP8 matmuls come from the model's kernel selector (Ops.fp8_linear / fp8_batched),
    never from the device: a backend whose FP8 entries count their calls (the torch references
    behind them) runs every kept FP8 weight of Qwen3-Next (linear layers, FP8 experts) through
    them, with the torch backend's logits."""
    import dataclasses

    from mtpkit.kernels import ops as kernels

    fp8_dir, _, _, _ = fp8_dirs("qwen", "block16x32")
    calls = {"fp8_linear": 0, "fp8_batched": 0}

    def counted(name):
        fn = getattr(kernels.TORCH, name)

        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    spy = dataclasses.replace(kernels.TORCH, name="spy", **{n: counted(n) for n in calls})
    monkeypatch.setitem(kernels._REGISTRY, "spy", lambda: spy)
    want = _llm(fp8_dir, dtype="float32", keep_fp8=True, attn_backend="torch").score(PROMPT)
    assert calls == {"fp8_linear": 0, "fp8_batched": 0}
    llm = _llm(fp8_dir, dtype="float32", keep_fp8=True, attn_backend="spy")
    mats = [m for m in llm.model.modules() if isinstance(m, FP8Matrix)]
    assert mats and all(m.ops is spy for m in mats)
    got = llm.score(PROMPT)
    assert calls["fp8_linear"] > 0 and calls["fp8_batched"] > 0
    assert torch.equal(got, want)


def test_keep_fp8_is_checked(fp8_pair):
    with pytest.raises(ConfigError, match="keep_fp8='yes' must be True, False or None"):
        _llm(fp8_pair[0], keep_fp8="yes")


# ---- layouts, shards -------------------------------------------------------------------


def test_row_layout_block_or_named_scale_rows():
    """Whole stored blocks moved whole (one head's q rows, then k ...) give the block layout
    (the table lists their scale rows in output order); a block of output rows drawn from two
    stored blocks makes every row name its own."""
    from mtpkit.layers.fp8_layout import Part

    parts = [Part("q", 64, 0, 64), Part("k", 32, 0, 32)]
    order = torch.cat([torch.arange(32, 64), torch.arange(64, 96), torch.arange(0, 32)])
    lay = row_layout(*row_sources(parts, order), 16)
    assert lay.scale_rows is None
    assert lay.table.tolist() == [[0, 2], [0, 3], [1, 0], [1, 1], [0, 0], [0, 1]]
    lay = row_layout(*row_sources([Part("a", 40, 0, 40), Part("b", 16, 0, 16)], None), 16)
    assert lay.table.tolist() == [[0, 0], [0, 1], [0, 2], [1, 0]]
    assert lay.scale_rows.tolist() == [0] * 16 + [1] * 16 + [2] * 8 + [3] * 16


def _load(layer, tensors, prefix="m"):
    for spec in layer.checkpoint_specs(prefix):
        assert set(spec.sources) <= set(tensors)
        spec.param.data = spec.assemble(tensors)


def test_fp8_shards_that_cut_blocks():
    """Tensor-parallel shards of whole blocks take their blocks' scales; shards that cut a
    block keep FP8 too: column shards' rows name their scale rows, row shards' columns are
    widened to whole blocks (zero outside the shard) and the input padded. The ranks' products
    make the whole layer's (concatenated, or summed: the all-reduce)."""
    torch.manual_seed(1)
    block = (16, 32)
    w = torch.randn(64, 96)
    q, s = quantize(w, block)
    x = torch.randn(3, 96)
    for rows, cols, cut in ((64, 96, False), (48, 96, True)):   # rank 1's 24-row half starts inside a block
        w_part = {"m.weight": q[:rows], "m.weight_scale_inv": s[:-(-rows // 16)]}
        want = fp8_linear(x, q[:rows], s[:-(-rows // 16)], block)
        parts = []
        for rank in (0, 1):
            layer = ColumnParallelLinear(cols, rows, TP(rank=rank, size=2))
            assert layer.use_fp8(block, "m", {"m.weight": "m.weight_scale_inv"})
            _load(layer, w_part)
            seg = layer.fp8.segments[0]
            assert (seg.scale_rows is not None) == (cut and rank == 1) and seg.weight.dtype == torch.float8_e4m3fn
            parts.append(layer(x))
        torch.testing.assert_close(torch.cat(parts, dim=-1), want)
    for cols, cut in ((96, True), (64, False)):   # 48-column halves cut a 32-column block; 32 do not
        xs = x[:, :cols]
        want = fp8_linear(xs, q[:, :cols], s[:, :-(-cols // 32)], block)
        total = 0
        for rank in (0, 1):
            layer = RowParallelLinear(cols, 64, TP(rank=rank, size=2))
            assert layer.use_fp8(block, "m", {"m.weight": "m.weight_scale_inv"})
            _load(layer, {"m.weight": q[:, :cols], "m.weight_scale_inv": s[:, :-(-cols // 32)]})
            seg = layer.fp8.segments[0]
            assert any(seg.k_pad) == cut and seg.weight.shape[1] == (64 if cut else 32)
            half = cols // 2
            total = total + seg(xs[:, rank * half:(rank + 1) * half])   # the rank's partial product
        # each rank quantizes its own input columns (its own amax): equal to the activations' rounding
        torch.testing.assert_close(total, want, atol=0.08 * want.abs().max().item(), rtol=0)
        with lossless_activations():
            total = sum(_row_part(q, s, block, cols, r, xs) for r in (0, 1))
            exact = xs @ dequantize(q[:, :cols], s[:, :-(-cols // 32)], block, torch.float32).t()
            torch.testing.assert_close(total, exact, atol=1e-5, rtol=1e-5)


def _row_part(q, s, block, cols, rank, xs):
    layer = RowParallelLinear(cols, 64, TP(rank=rank, size=2))
    layer.use_fp8(block, "m", {"m.weight": "m.weight_scale_inv"})
    _load(layer, {"m.weight": q[:, :cols], "m.weight_scale_inv": s[:, :-(-cols // 32)]})
    half = cols // 2
    return layer.fp8.segments[0](xs[:, rank * half:(rank + 1) * half])


def test_merged_weight_of_fp8_and_plain_parts():
    """A merged projection whose parts are partly unquantized runs each kind on its own and
    concatenates: [FP8 | plain | FP8] rows in output order."""
    torch.manual_seed(2)
    block = (16, 32)
    a, b, c = torch.randn(32, 64), torch.randn(16, 64), torch.randn(24, 64)
    qa, sa = quantize(a, block)
    qc, sc = quantize(c, block)
    layer = MergedColumnParallelLinear(64, [("a", 32, 1, False), ("b", 16, 1, False), ("c", 24, 1, False)])
    fp8 = {"p.a.weight": "p.a.weight_scale_inv", "p.c.weight": "p.c.weight_scale_inv"}
    assert layer.use_fp8(block, "p.abc", fp8)
    assert _segments(layer.fp8) == ["FP8Matrix", "PlainRows", "FP8Matrix"]
    _load(layer, {"p.a.weight": qa, "p.a.weight_scale_inv": sa, "p.b.weight": b, "p.c.weight": qc,
                  "p.c.weight_scale_inv": sc}, "p.abc")
    assert isinstance(layer.fp8.segments[1], PlainRows) and torch.equal(layer.fp8.segments[1].weight, b)
    x = torch.randn(5, 64)
    want = torch.cat([fp8_linear(x, qa, sa, block), x @ b.t(), fp8_linear(x, qc, sc, block)], -1)
    torch.testing.assert_close(layer(x), want)
    assert not Linear(64, 8).use_fp8(block, "q", fp8)   # no part of it is FP8: stays plain


# ---- refused files, scale formats ------------------------------------------------------


def test_inconsistent_fp8_checkpoints_are_refused(fp8_pair, tmp_path):
    fp8_dir, _, _, names = fp8_pair
    bad = tmp_path / "bad"
    shutil.copytree(fp8_dir, bad)
    f = bad / "model.safetensors"
    tensors = _tensors(bad)
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


def test_ue8m0_scales(fp8_dirs, tmp_path):
    """scale_fmt "ue8m0": power-of-two scales stored as float8_e8m0fnu, read as fp32 whether
    the weight is dequantized (CPU) or kept in FP8."""
    src, _, block, names = fp8_dirs("qwen", "block16x32")
    d = tmp_path / "ue8m0"
    shutil.copytree(src, d)
    tensors = _tensors(d)
    for n in names:
        w = dequantize(tensors[n], tensors[n + "_scale_inv"], block, torch.float32)
        s = torch.exp2(torch.ceil(torch.log2(tensors[n + "_scale_inv"])))
        tensors[n] = (w / s.repeat_interleave(block[0], 0)[:w.shape[0]].repeat_interleave(block[1], 1)[:, :w.shape[1]]
                      ).to(torch.float8_e4m3fn)
        tensors[n + "_scale_inv"] = s.to(torch.float8_e8m0fnu)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["scale_fmt"] = "ue8m0"
    (d / "config.json").write_text(json.dumps(cfg))
    name = "model.layers.3.self_attn.o_proj.weight"
    want = dequantize(tensors[name], tensors[name + "_scale_inv"], block, torch.float32)
    llm = _llm(d, dtype="float32")
    assert torch.equal(llm.model.layers[3].self_attn.o_proj.weight, want)
    kept = _llm(d, dtype="float32", keep_fp8=True)
    o = kept.model.layers[3].self_attn.o_proj.fp8.segments[0]
    assert o.weight_scale_inv.dtype == torch.float32
    assert torch.equal(o.weight_scale_inv, tensors[name + "_scale_inv"].float())
    assert kept.model.layers[0].mlp.fp8.w13.weight_scale_inv.dtype == torch.float32
    want = llm.score(PROMPT)
    with lossless_activations():  # the weights' products alone
        _close(kept.score(PROMPT), want, "float32")
