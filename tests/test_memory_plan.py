"""Memory planning (mtpkit/engine/memory_plan.py) on CPU with explicit budgets: the pools fill
what the budget leaves after the weights (computed before loading, checked against the loaded
model) and the activation estimate; the plan is printed; a model that cannot fit is refused
with the numbers before any weight is read; FP8 layers are counted at their stored bytes."""

import pytest
import torch

from mtpkit import LLM, SamplingParams
from mtpkit.engine import memory_plan
from mtpkit.engine.build import resize_to_measured
from mtpkit.errors import ConfigError
from mtpkit.checkpoint import loader
from test_model_family import F64, toy  # noqa: F401  (the toy family and its checkpoints)

MiB = 1 << 20


@pytest.fixture(scope="module")
def ckpt(hf_checkpoint):
    return hf_checkpoint("base", 0)[1]


def _llm(path, **kw):
    return LLM(str(path), num_spec=2, max_num_seqs=4, max_model_len=256, max_num_batched_tokens=64, **kw)


def _bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def test_budget_sizes_the_pools(ckpt, capsys):
    budget = 6 * MiB
    llm = _llm(ckpt, memory_budget=budget, dtype="float32")
    plan = llm.memory_plan
    # the weights computed before loading are the loaded model's bytes
    assert plan.weight_bytes == _bytes(list(llm.model.parameters()) + list(llm.model.buffers()))
    # the allocated caches are the plan's, and they take what the budget leaves (to one block)
    cache = [t for t in _flatten(llm.cache)]
    assert _bytes(cache) == plan.cache_bytes
    left = budget - plan.weight_bytes - plan.activation_bytes - plan.control_bytes - plan.cache_bytes
    assert 0 <= left < plan.bytes_per_block
    ecfg = llm.engine_config
    assert plan.num_slots == 1 + ecfg.max_num_seqs * ecfg.bundle
    assert llm.kv_pools.num_free == {"full": plan.num_blocks - 1}
    assert plan.max_concurrent == min(ecfg.max_num_seqs, (plan.num_blocks - 1) // ecfg.max_blocks) >= 1
    err = capsys.readouterr().err
    assert f"{plan.num_blocks} KV blocks" in err and f"{plan.num_slots} state slots" in err
    assert f"at most {plan.max_concurrent} concurrent requests at max_model_len=256" in err
    # a larger budget goes to the KV pool
    bigger = _llm(ckpt, memory_budget=budget + 100 * plan.bytes_per_block, dtype="float32").memory_plan
    assert bigger.num_blocks == plan.num_blocks + 100 and bigger.num_slots == plan.num_slots
    out = llm.generate([[1, 2, 3, 4]] * 4, SamplingParams(max_tokens=8))
    assert all(len(o.token_ids) == 8 for o in out)
    # the generation controls' tables, allocated at the first step using one, are what was reserved
    assert llm.runner.control_tables is None and plan.control_bytes > 0
    assert "generation controls' tables" in err
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, repetition_penalty=1.3))
    assert _bytes(llm.runner.control_tables.tensors()) == plan.control_bytes


def _flatten(cache):
    if isinstance(cache, torch.Tensor):
        yield cache
    elif isinstance(cache, dict):
        for v in cache.values():
            yield from _flatten(v)
    elif isinstance(cache, (list, tuple)):
        for v in cache:
            yield from _flatten(v)
    elif hasattr(cache, "__dict__"):
        for v in vars(cache).values():
            yield from _flatten(v)


def test_cannot_fit_is_refused_before_weights_load(ckpt, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("weights were read")
    monkeypatch.setattr(loader, "load_checkpoint", no_load)
    meta = memory_plan.meta_model(*_family(ckpt), path=ckpt, load_format="safetensors",
                                  device=torch.device("cpu"), attn_backend=None, tp=_tp(), with_mtp=True)
    weights = memory_plan.weight_bytes(meta, torch.float32)
    # room for the weights and the activations, not for the caches
    budget = weights + 300_000
    with pytest.raises(ConfigError) as e:
        _llm(ckpt, memory_budget=budget, dtype="float32")
    msg = str(e.value)
    assert f"cannot fit in memory_budget={budget}" in msg and "short" in msg, msg
    assert f"weights need {weights / MiB:.1f} MiB" in msg and "state pool" in msg and "KV pool" in msg
    # a budget below the weights alone
    with pytest.raises(ConfigError, match="cannot fit"):
        _llm(ckpt, memory_budget=weights // 2, dtype="float32")


def _family(path):
    from mtpkit.models.registry import read_config
    return read_config(path)


def _tp():
    from mtpkit.parallel import TP
    return TP.single()


def test_budget_options_are_checked(ckpt):
    with pytest.raises(ConfigError, match="gpu_memory_utilization needs a CUDA device.*memory_budget"):
        _llm(ckpt, gpu_memory_utilization=0.9)
    with pytest.raises(ConfigError, match="num_blocks=100 and a memory budget both size the caches"):
        _llm(ckpt, memory_budget=64 * MiB, num_blocks=100)
    with pytest.raises(ConfigError, match="either gpu_memory_utilization or memory_budget"):
        _llm(ckpt, memory_budget=64 * MiB, gpu_memory_utilization=0.5)


@pytest.mark.parametrize("block", [(16, 32), (128, 128)])
def test_fp8_layers_counted_at_stored_bytes(ckpt, tmp_path, block):
    """On CUDA every FP8 weight is kept (1 byte each) with its fp32 scales (and, where parts
    cut blocks ([128, 128] on the tiny model), an int32 scale row per weight row): the plan's
    weight bytes (meta model, from config.json and the headers) equal those of the model
    loaded that way (forced here on CPU) and are below the dequantized model's."""
    from test_fp8 import make_fp8

    make_fp8(ckpt, tmp_path / "fp8", tmp_path / "twin", block)
    path = tmp_path / "fp8"
    family, cfg = _family(path)
    meta = memory_plan.meta_model(family, cfg, path=path, load_format="safetensors", device=torch.device("cpu"),
                                  attn_backend=None, tp=_tp(), with_mtp=True)
    dequantized = memory_plan.weight_bytes(meta, torch.bfloat16)
    kept_meta = memory_plan.meta_model(family, cfg, path=path, load_format="safetensors", device=torch.device("cpu"),
                                       attn_backend=None, tp=_tp(), keep_fp8=True, with_mtp=True)
    assert any(p.dtype == torch.float8_e4m3fn for p in kept_meta.parameters())
    planned = memory_plan.weight_bytes(kept_meta, torch.bfloat16)
    model = family.model_class(cfg, _ops(), _tp(), with_mtp=True)
    loader.load_checkpoint(model, path, torch.bfloat16, torch.device("cpu"), keep_fp8=True)
    assert planned == _bytes(list(model.parameters()) + list(model.buffers()))
    assert planned < dequantized
    rows = [b for n, b in model.named_buffers() if n.endswith("scale_rows")]
    assert bool(rows) == (block == (128, 128))
    est = dict(tokens=64, logits_rows=8, vocab=cfg.vocab_size, dtype=torch.bfloat16)
    assert memory_plan.activation_estimate(kept_meta, **est) == memory_plan.activation_estimate(meta, **est)


def test_fp8_experts_estimate_the_activations_of_the_plain_layout():
    """A MoE kept in FP8 holds its experts' down projections as a stack [experts, hidden, I]:
    not a per-token width, so the estimate is the plain layout's (every local expert's gate
    and up rows per token), here where hidden (64) > 2I (32) would tell them apart."""
    from mtpkit.layers.moe import SparseMoE

    est = dict(tokens=64, logits_rows=8, vocab=1000, dtype=torch.bfloat16)
    with torch.device("meta"):
        plain = SparseMoE(64, 4, 2, 16, 16, True, _tp())
        kept = SparseMoE(64, 4, 2, 16, 16, True, _tp())
    names = [f"m.experts.{e}.{p}_proj.weight" for e in range(4) for p in ("gate", "up", "down")]
    names += [f"m.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")]
    assert kept.use_fp8((16, 32), "m", {n: n + "_scale_inv" for n in names}) and kept.fp8 is not None
    assert memory_plan.activation_estimate(kept, **est) == memory_plan.activation_estimate(plain, **est) \
        == 4 * 64 * (4 * 32) * 2 + 2 * 8 * 1000 * 4


def _ops():
    from mtpkit.kernels.ops import select_ops
    return select_ops(torch.device("cpu"), None)


def test_profile_run_resizes_the_kv_pool(ckpt, monkeypatch):
    """The CUDA step after loading, run on CPU with torch.cuda's memory counters stood in:
    the profile run's measured peak replaces the estimate, the KV pool is reallocated at the
    size that leaves, and the engine runs on the new pools."""
    budget = 6 * MiB
    llm = _llm(ckpt, memory_budget=budget, dtype="float32")
    estimated = llm.memory_plan
    peak = estimated.activation_bytes + 50 * estimated.bytes_per_block
    calls = []
    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, name=name: calls.append(name))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 1000)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 1000 + peak)
    scored = []
    orig_score = llm.engine.score
    monkeypatch.setattr(llm.engine, "score", lambda ids: scored.append(len(ids)) or orig_score(ids))
    meta = [memory_plan.meta_model(*_family(ckpt), path=ckpt, load_format="safetensors",
                                   device=torch.device("cpu"), attn_backend=None, tp=_tp(), with_mtp=True)]
    resize_to_measured(llm.engine, (budget, f"memory_budget={budget}"), meta)
    plan = llm.memory_plan
    assert scored == [64] and "reset_peak_memory_stats" in calls    # one prefill of max_num_batched_tokens
    assert plan.activation_source == "measured" and plan.activation_bytes == peak
    assert plan.num_blocks == estimated.num_blocks - 50 and plan.num_slots == estimated.num_slots
    assert _bytes(list(_flatten(llm.cache))) == plan.cache_bytes
    assert llm.kv_pools.num_free == {"full": plan.num_blocks - 1} and llm.runner.cache is llm.cache
    out = llm.generate([[1, 2, 3, 4]] * 4, SamplingParams(max_tokens=8))
    assert all(len(o.token_ids) == 8 for o in out)


def test_budget_counts_a_separate_draft_model(toy):
    """A drafter with its own model (draft_model=) adds its weights to the plan."""
    llm = LLM(toy["target"], num_spec=3, draft_model=toy["other"], memory_budget=16 * MiB, **F64)
    target = _bytes(list(llm.model.parameters()) + list(llm.model.buffers()))
    draft = _bytes(list(llm.drafter.model.parameters()) + list(llm.drafter.model.buffers()))
    assert draft > 0 and llm.memory_plan.weight_bytes == target + draft
