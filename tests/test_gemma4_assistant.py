"""The Gemma 4 assistant drafter (LLM(target, draft_model=assistant, num_spec=k)) on tiny
random Gemma 4 targets (dense, MoE, E2B-like, multimodal layout) with assistants built by
transformers 5.24 (gemma4_assistant_oracle.py), in float64:

- drafts equal transformers' drafts for the same committed context, after a prefill and
  after a fully accepted round (where transformers' drafts are clean), for every request of
  a batch and at batch 1 (chunked prefill), with and without ordered embeddings, contexts
  shorter and longer than the window; after a partial rejection they equal the drafts of
  the committed context alone (transformers would read the rejected drafts' KV);
- greedy output with the assistant equals greedy output without it, num_spec 1..6, with
  assistants built to agree with their targets (full and partial acceptances) and a random
  one (rejections, preemption); sampled output has the target's distribution (chi-square);
- exact metrics for all-accept and all-reject runs; CPU graphs (traced verify, proposal and
  prefill proposal, padded rows) equal eager;
- every incompatibility is a ConfigError before any weight is read; serve_batch and debug
  mode; recycled sliding-window blocks keep what the assistant reads.
Tensor parallelism and the Triton backend: test_gemma4_assistant_tp.py and _triton.py.
"""

import json
import os
import shutil
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gemma4_assistant_oracle as A  # noqa: E402
import oracle as O  # noqa: E402
import spec_metrics as M  # noqa: E402

pytest.importorskip("transformers")

from mtpkit import LLM, SamplingParams  # noqa: E402
from mtpkit.errors import CheckpointError, ConfigError  # noqa: E402

F64 = dict(dtype="float64", device="cpu", max_model_len=96)
PROMPT_LENS = (3, 9, 30)      # windows are 5..7 keys: shorter, about as long, far longer
V = 128


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Factory (target name, kind, ordered, eps, seed, norm_scale) -> (HF target, HF
    assistant, target dir, assistant dir); each built and saved once. kind: "random",
    "agree" (eps, norm_scale: gemma4_assistant_oracle.bigram_target), "all_accept",
    "all_reject"."""
    root, made = tmp_path_factory.mktemp("assistant"), {}

    def get(name, kind="random", ordered=False, eps=0.0, seed=0, norm_scale=1.0):
        key = (name, kind, ordered, eps, seed, norm_scale)
        if key not in made:
            if kind == "random":
                t, a = A.build_target(name, seed), A.build_assistant(name, seed, ordered=ordered)
            elif kind == "agree":
                t = A.bigram_target(name, seed, eps, norm_scale)
                a = A.build_assistant(name, seed, ordered=ordered, agree_with=t, eps=eps)
            else:
                t, a = getattr(A, f"{kind}_pair")(name, seed)
            d = root / "_".join(map(str, key))
            A.save(t, d / "target")
            A.save(a, d / "assistant")
            made[key] = (t, a, d / "target", d / "assistant")
        return made[key]
    return get


def _prompts(lens=PROMPT_LENS, seed=40):
    return [O.random_prompt(n, V, seed=seed + n) for n in lens]


def _llm(pair, k, **kw):
    return LLM(pair[2], draft_model=pair[3], num_spec=k, **{**F64, "max_num_seqs": 4, **kw})


def _check(ours, theirs, logits, what):
    assert A.tie_aware_equal(ours, theirs, logits), f"{what}: mtpkit drafted {ours}, transformers {theirs}"


def _prefill(llm, prompts, max_tokens=40):
    reqs = [llm.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
    while any(not r.output_token_ids for r in reqs):
        llm.step()
    return reqs


def _check_prefill_and_full_round(llm, pair, prompts, k):
    hf_t, hf_a = pair[:2]
    reqs = _prefill(llm, prompts)
    rounds = []
    for p, r in zip(prompts, reqs):
        t, hf, logits = A.drafts_after_prefill(hf_t, hf_a, p, k)
        assert r.output_token_ids == [t]
        _check(r.drafts, hf, logits, f"after prefilling {len(p)} tokens")
        committed, hf, logits = A.drafts_after_full_round(hf_t, hf_a, p, k)
        r.drafts = committed[1:k + 1]            # the target's own greedy tokens: all accepted
        rounds.append((committed, hf, logits))
    llm.step()
    for p, r, (committed, hf, logits) in zip(prompts, reqs, rounds):
        assert r.prev_num_emitted == k + 1 and r.output_token_ids == committed
        _check(r.drafts, hf, logits, f"after a full round on {len(p)} prompt tokens")


# ---- drafts == transformers' drafts ------------------------------------------------------------

@pytest.mark.parametrize("name,ordered", [("dense", False), ("dense", True), ("moe", False), ("moe", True),
                                          ("e2b", False), ("e2b", True), ("mm", True)])
def test_drafts_equal_transformers_for_each_request_of_a_batch(pairs, name, ordered):
    pair = pairs(name, ordered=ordered)
    _check_prefill_and_full_round(_llm(pair, 4), pair, _prompts(), 4)


@pytest.mark.parametrize("name,ordered,k", [("dense", True, 3), ("e2b", False, 5)])
def test_drafts_equal_transformers_at_batch_one_after_a_chunked_prefill(pairs, name, ordered, k):
    pair = pairs(name, ordered=ordered)
    for p in _prompts((4, 27), seed=7):
        _check_prefill_and_full_round(_llm(pair, k, max_num_seqs=1, max_num_batched_tokens=8), pair, [p], k)


@pytest.mark.parametrize("name", ["dense", "e2b"])
def test_drafts_after_a_partial_rejection_read_only_the_committed_context(pairs, name):
    """Request i's verify step accepts i drafts of 4, so its bundle wrote KV for rejected
    drafts at positions >= p. Its next drafts equal transformers' drafts after prefilling
    the committed context (clean), which a read of those positions would change: as
    transformers' own drafter shows, whose drafts there (stale KV) differ."""
    pair, k = pairs(name), 4
    hf_t, hf_a = pair[:2]
    prompts = _prompts()
    llm = _llm(pair, k)
    reqs = _prefill(llm, prompts)
    for a, (p, r) in enumerate(zip(prompts, reqs)):
        g = A.greedy(hf_t, p + r.output_token_ids, k)
        r.drafts = g[:a] + [(g[a] + 1) % V] + g[a + 1:]    # draft a+1 is wrong
    llm.step()
    stale_differs = []
    for a, (p, r) in enumerate(zip(prompts, reqs)):
        assert r.prev_num_emitted == a + 1
        context = p + r.output_token_ids
        t, hf, logits = A.drafts_after_prefill(hf_t, hf_a, context[:-1], k)
        assert t == context[-1]
        _check(r.drafts, hf, logits, f"after accepting {a} of {k} drafts")
        committed, stale = A.drafts_after_partial_round(hf_t, hf_a, p, k, a)
        assert committed == r.output_token_ids
        stale_differs.append(stale != hf)
    assert any(stale_differs), "reading the rejected drafts' KV was meant to change transformers' drafts"


def _poison_outside_the_round(llm):
    """Wrap the drafter so that, while it proposes, every KV slot of every real row that its
    round must not read holds NaN (restored after): positions >= p in every target group, and
    in sliding groups positions below p-W-1 (blocks the engine may recycle). A read of one,
    even masked, turns the drafts into garbage (0 * NaN)."""
    drafter, propose = llm.runner.drafter, llm.runner.drafter.propose
    bs, W = llm.engine_config.block_size, llm.model_config.sliding_window

    def poisoned(inp, cache):
        p = (inp.positions[inp.last_idx] + 1).tolist()
        saved = []
        for group, layers in cache.kv.items():
            for row, table in enumerate(inp.block_tables[cache.pool_index[group]].tolist()):
                low = p[row] - W - 1 if "sliding" in group else 0
                # the row's own blocks only (a padded row's, and recycled entries, are the null block)
                slots = [table[q // bs] * bs + q % bs for q in range(len(table) * bs)
                         if table[q // bs] and (q >= p[row] or q < low)]
                if not slots:
                    continue
                slots = torch.tensor(slots, dtype=torch.int64)
                for k_cache, v_cache in layers:
                    for c in (k_cache, v_cache):
                        flat = c.view(-1, *c.shape[2:])
                        saved.append((flat, slots, flat[slots].clone()))
                        flat[slots] = float("nan")
        try:
            return propose(inp, cache)
        finally:
            for flat, slots, values in reversed(saved):
                flat[slots] = values
    drafter.propose = poisoned


@pytest.mark.parametrize("name,ordered", [("dense", True), ("e2b", False)])
def test_drafts_never_read_keys_outside_the_round(pairs, name, ordered):
    """With NaN in every slot the round must not read (see _poison_outside_the_round), the
    drafts still equal transformers', after a prefill and after a full round (block size 4:
    the sliding reads start inside a block, with whole poisoned blocks below)."""
    pair = pairs(name, ordered=ordered)
    llm = _llm(pair, 3, block_size=4)
    _poison_outside_the_round(llm)
    _check_prefill_and_full_round(llm, pair, _prompts(), 3)


# ---- losslessness and the sampled distribution ----------------------------------------------------

_REF: dict = {}


def _greedy(target_dir, prompts, max_tokens, **kw):
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    llm = LLM(target_dir, **{**F64, **kw})
    return [o.token_ids for o in llm.generate(prompts, params)], llm


def _reference(target_dir, prompts, max_tokens):
    key = (str(target_dir), str(prompts), str(max_tokens))
    if key not in _REF:
        _REF[key] = _greedy(target_dir, prompts, max_tokens, max_num_seqs=8)[0]
    return _REF[key]


LOSSLESS_PROMPTS = _prompts((1, 4, 13, 29, 40), seed=70)
LOSSLESS_MAX_TOKENS = [24, 17, 30, 9, 21]


@pytest.mark.parametrize("k,name,eps,ordered", [(1, "dense", 0.1, False), (2, "moe", 0.1, False),
                                                 (3, "e2b", 0.05, True), (4, "dense", 0.1, True),
                                                 (5, "moe", 0.05, False), (6, "e2b", 0.1, False)])
def test_lossless_with_an_agreeing_assistant(pairs, k, name, eps, ordered):
    """Greedy output with the assistant == without, token for token; the assistant agrees
    often enough that whole rounds are accepted and others rejected part-way."""
    pair = pairs(name, "agree", ordered, eps)
    ref = _reference(pair[2], LOSSLESS_PROMPTS, LOSSLESS_MAX_TOKENS)
    ours, llm = _greedy(pair[2], LOSSLESS_PROMPTS, LOSSLESS_MAX_TOKENS, draft_model=pair[3], num_spec=k,
                        max_num_seqs=3)
    assert ours == ref, f"num_spec={k}: output differs; stats {llm.stats}"
    s = llm.stats
    assert s.accepted_per_position[-1] > 0, f"no round accepted all {k} drafts: {s}"
    assert s.num_accepted < s.num_drafted, f"no draft was rejected: {s}"


def test_lossless_with_a_random_assistant_under_preemption(pairs):
    """A random assistant (almost every draft rejected) on the multimodal layout, a KV pool
    of two sequences for four requests (preemption and recomputation)."""
    pair, k = pairs("mm"), 3
    ref = _reference(pair[2], LOSSLESS_PROMPTS, LOSSLESS_MAX_TOKENS)
    ours, llm = _greedy(pair[2], LOSSLESS_PROMPTS, LOSSLESS_MAX_TOKENS, draft_model=pair[3], num_spec=k,
                        max_num_seqs=4, num_blocks=1 + 2 * 6)
    assert ours == ref
    assert llm.stats.num_drafted > 0 and llm.stats.num_accepted < llm.stats.num_drafted


@pytest.mark.parametrize("params,k", [(dict(temperature=1.0), 1), (dict(temperature=0.7, top_k=6, top_p=0.9), 3)])
def test_sampling_distribution_matches_target(pairs, params, k):
    """The second token (drawn through the accept test of a one-hot greedy draft) is
    distributed exactly as sampling the target alone."""
    pair = pairs("dense_v16", "agree", eps=0.3, norm_scale=0.3)   # flat enough for many outcomes
    prompt = [3, 1, 4, 1, 5]
    expected = M.exact_second_token_p(pair[2], prompt, params)
    counts, llm = M.second_token_distribution(pair[2], prompt, params, k, 2400, draft_model=pair[3])
    p = M.chi2_pvalue(counts, expected)
    assert p > 1e-4, f"num_spec={k}: chi-square p-value {p:.2e}; counts {counts.tolist()}"
    assert 0.1 < llm.stats.acceptance_rate_per_position[0] < 0.95     # both outcomes happen


# ---- metrics, graphs ----------------------------------------------------------------------------

@pytest.mark.parametrize("kind,k", [("all_accept", 1), ("all_accept", 4), ("all_reject", 2), ("all_reject", 5)])
def test_all_accept_and_all_reject_metrics(pairs, kind, k):
    pair = pairs("dense", kind)
    prompts = [O.random_prompt(n, V, seed=2 + n) for n in (4, 9, 17)]
    mt = [10, 17, 23]
    ours, llm = _greedy(pair[2], prompts, mt, draft_model=pair[3], num_spec=k)
    assert ours == _reference(pair[2], prompts, mt)
    accept = kind == "all_accept"
    assert all((t == [0] * m) == accept and (0 in t) == accept for t, m in zip(ours, mt))
    exp = [M.expected_steps(m, k, accept) for m in mt]
    s = llm.stats
    assert s.verify_steps == sum(e[0] for e in exp)
    assert s.num_drafted == sum(e[1] for e in exp) and s.num_accepted == sum(e[2] for e in exp)
    assert s.acceptance_rate_per_position == [1.0 if accept else 0.0] * k
    assert s.mean_acceptance_length == pytest.approx(1 + s.num_accepted / s.verify_steps)


@pytest.mark.parametrize("name,ordered", [("dense", True), ("moe", False), ("e2b", False)])
def test_graphs_equal_eager(pairs, name, ordered):
    """Traced CPU graphs (verify, proposal, prefill proposal; 3 requests padded to 4 rows)
    give the tokens and acceptance counts of the eager path."""
    pair = pairs(name, "agree", ordered, 0.3)
    prompts, mt = _prompts(), [20, 20, 20]

    def run(**kw):
        llm = LLM(pair[2], draft_model=pair[3], num_spec=3, max_num_seqs=4, graph_sizes=[1, 2, 4], **F64, **kw)
        if llm.runner.graphs is not None:
            llm.runner.graphs.trace_after = 0
        outs = llm.generate(prompts, [SamplingParams(max_tokens=m, ignore_eos=True) for m in mt])
        return [o.token_ids for o in outs], llm
    eager, e = run(enforce_eager=True)
    graphs, g = run()
    assert graphs == eager
    assert (g.stats.accepted_per_position, g.stats.num_drafted) == (e.stats.accepted_per_position, e.stats.num_drafted)
    assert g.stats.num_accepted > 0
    runner = g.runner.graphs
    assert runner.trace and any(f is not None for f in runner.propose_graphs.values()) and runner.prefill_proposal_graphs
    assert (4, 64) in runner.verify_graphs, "three requests were meant to run padded to four rows"


# ---- compatibility, checked before any weight is read -----------------------------------------------

def _config_only(pair, tmp_path, **overrides):
    """The assistant's config.json with fields replaced (text_config fields under "text"),
    in a directory without weights."""
    raw = json.loads((pair[3] / "config.json").read_text())
    raw["text_config"].update(overrides.pop("text", {}))
    raw.update(overrides)
    d = tmp_path / "assistant_config_only"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(raw))
    return d


MISMATCHES = {  # the change, what the error must name
    "head_dim": (dict(text=dict(head_dim=8)), "sliding_attention layers have head_dim=8"),
    "kv_heads": (dict(text=dict(per_layer_config={"2": {"head_dim": 32, "num_key_value_heads": 2}})),
                 "full_attention layers have num_key_value_heads=2"),
    "window": (dict(text=dict(sliding_window=9)), "sliding_window=9 differs"),
    "rope": (dict(text=dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 5e4},
                                             "full_attention": {"rope_type": "proportional", "rope_theta": 1e6,
                                                                "partial_rotary_factor": 0.25}})),
             "rope_parameters['sliding_attention']"),
    "backbone": (dict(backbone_hidden_size=32), "backbone_hidden_size=32 differs from the target's hidden_size=64"),
    "vocab": (dict(text=dict(vocab_size=96)), "vocab_size=96 differs from the target's 128"),
}


@pytest.mark.parametrize("what", sorted(MISMATCHES))
def test_each_mismatch_is_a_config_error_before_weights(pairs, tmp_path, what):
    change, message = MISMATCHES[what]
    d = _config_only(pairs("dense"), tmp_path, **change)      # no weights at all: refused from config.json
    with pytest.raises(ConfigError, match="cannot draft for this target") as e:
        LLM(pairs("dense")[2], draft_model=d, num_spec=2, **F64)
    assert message in str(e.value)


def test_every_mismatch_is_listed_in_one_error(pairs, tmp_path):
    text, top = {}, {}
    for change, _ in MISMATCHES.values():
        text.update(change.get("text", {}))
        top.update({k: v for k, v in change.items() if k != "text"})
    d = _config_only(pairs("dense"), tmp_path, text=text, **top)
    with pytest.raises(ConfigError) as e:
        LLM(pairs("dense")[2], draft_model=d, num_spec=2, **F64)
    for _, message in MISMATCHES.values():
        assert message in str(e.value)


@pytest.mark.parametrize("text,message", [
    (dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=8), "enable_moe_block"),
    (dict(hidden_size_per_layer_input=8), "hidden_size_per_layer_input=8 must be 0"),
    (dict(num_kv_shared_layers=1), "num_kv_shared_layers=1"),
])
def test_assistant_features_it_cannot_have(pairs, tmp_path, text, message):
    d = _config_only(pairs("dense"), tmp_path, text=text)
    with pytest.raises(ConfigError, match=message):
        LLM(pairs("dense")[2], draft_model=d, num_spec=2, **F64)


def test_ordered_embeddings_need_a_token_ordering(pairs, tmp_path):
    """use_ordered_embeddings without masked_embedding.token_ordering in the checkpoint is
    refused from its headers; an untrained (all-zero) ordering when it is loaded."""
    from safetensors.torch import load_file, save_file
    pair = pairs("dense", ordered=True)
    sd = load_file(pair[3] / "model.safetensors")
    missing = tmp_path / "no_ordering"
    shutil.copytree(pair[3], missing)
    save_file({n: t for n, t in sd.items() if n != "masked_embedding.token_ordering"}, missing / "model.safetensors")
    with pytest.raises(ConfigError, match="masked_embedding.token_ordering"):
        LLM(pair[2], draft_model=missing, num_spec=2, **F64)
    zeros = tmp_path / "zero_ordering"
    shutil.copytree(pair[3], zeros)
    save_file({**sd, "masked_embedding.token_ordering": torch.zeros(V, dtype=torch.int64)}, zeros / "model.safetensors")
    with pytest.raises(CheckpointError, match="not a permutation"):
        LLM(pair[2], draft_model=zeros, num_spec=2, **F64)


def test_an_assistant_is_not_a_target_and_drafts_only_for_gemma4(pairs, hf_checkpoint):
    pair = pairs("dense")
    with pytest.raises(ConfigError, match="pass it as draft_model="):
        LLM(pair[3], **F64)
    _, qwen = hf_checkpoint("base", 0)
    with pytest.raises(ConfigError, match="drafts only for Gemma 4 targets"):
        LLM(qwen, draft_model=pair[3], num_spec=2, **F64)


def test_tensor_parallel_split_of_the_assistant(pairs):
    from mtpkit.models.registry import drafter_kind_of, read_config
    from mtpkit.checkpoint.hub import read_config_json
    from mtpkit.speculative import gemma4_assistant
    pair = pairs("dense")
    _, target_cfg = read_config(pair[2])
    raw = read_config_json(pair[3])
    setup = gemma4_assistant.setup(drafter_kind_of(raw), raw, pair[3], target_cfg, 2, 16, "safetensors")
    setup.check_tensor_parallel(2)       # 4 heads, intermediate 80
    with pytest.raises(ConfigError, match="num_attention_heads=4 is not divisible by 3"):
        setup.check_tensor_parallel(3)
    assert (setup.kv_lookahead, setup.kv_read_back, setup.cache_spec(1).kv) == (0, 2, ())


# ---- front ends ------------------------------------------------------------------------------------

def test_serve_batch_drafts_with_the_assistant(pairs, tmp_path, capsys):
    """examples/serve_batch.py --draft-model: the assistant's incompatibility is an input
    error before the model loads; a compatible one generates the target's greedy tokens."""
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location(
        "serve_batch", Path(__file__).resolve().parent.parent / "examples" / "serve_batch.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    pair, prompts = pairs("dense", "agree", True, 0.1), _prompts()
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    args = ["--model", pair[2], "--prompts", tmp_path / "in.jsonl", "--num-spec", "3", "--max-tokens", "12", "--cpu",
            "--ignore-eos", "--dtype", "float64"]
    bad = _config_only(pair, tmp_path, backbone_hidden_size=32)
    assert mod.main([str(a) for a in args + ["--draft-model", bad, "--output", tmp_path / "bad.jsonl"]]) == 2
    assert "backbone_hidden_size=32" in capsys.readouterr().err and not (tmp_path / "bad.jsonl").exists()
    assert mod.main([str(a) for a in args + ["--draft-model", pair[3], "--output", tmp_path / "out.jsonl"]]) == 0
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["token_ids"] for r in rows] == _reference(pair[2], prompts, [12] * 3)
    assert sum(r["num_accepted"] for r in rows) > 0


def test_debug_mode_checks_the_assistant_boundaries(pairs):
    import mtpkit
    pair, prompts = pairs("e2b", "agree", True, 0.05), _prompts()
    ref = _reference(pair[2], prompts, [10] * 3)
    with mtpkit.debug() as trace:
        ours, _ = _greedy(pair[2], prompts, [10] * 3, draft_model=pair[3], num_spec=2, max_num_seqs=4)
    assert ours == ref
    called = {f.rsplit(".", 2)[-2] + "." + f.rsplit(".", 1)[-1] for f in trace.functions()}
    assert {"AssistantDrafter.propose", "Gemma4Assistant.step", "QOnlyAttention.forward",
            "MaskedEmbedding.argmax"} <= called, sorted(called)


# ---- sliding-window KV recycling -----------------------------------------------------------------

def test_recycled_sliding_kv_keeps_what_the_assistant_reads(pairs):
    """A generation far longer than the window with the sliding pool recycling its blocks
    (each freed block, and the null block, filled with NaN when freed): the assistant's drafts
    (eager), the tokens and the acceptance counts (eager and traced graphs) equal a run that
    keeps every block. Its reads reach below the target's window (kv_read_back), so those
    blocks must be kept: with kv_read_back 0 the drafts read freed blocks."""
    pair = pairs("dense", "agree", True, 0.1)
    W, prompts = 5, _prompts((12, 3), seed=90)
    params = SamplingParams(max_tokens=80, ignore_eos=True)
    base = dict(F64, max_model_len=120, block_size=4, max_num_batched_tokens=8, max_num_seqs=2)

    def run(poison, **kw):
        llm = LLM(pair[2], draft_model=pair[3], num_spec=3, **{**base, **kw})
        if llm.runner.graphs is not None:
            llm.runner.graphs.trace_after = 0
        else:  # eager: record every proposal (a host read, which a traced graph cannot hold)
            proposed, propose = [], llm.runner.drafter.propose
            llm.runner.drafter.propose = lambda inp, cache: proposed.append(propose(inp, cache)) or proposed[-1]
        freed = []
        if poison:
            groups = [g for g, i in llm.cache.pool_index.items() if llm.cache.pool_windows[i] == W]
            tensors = [t for g in groups for kv in llm.cache.kv[g] for t in kv]
            alloc = llm.kv_pools[f"sliding_{W}"]
            free = alloc.free

            def poisoned_free(blocks):
                for t in tensors:
                    t[blocks] = float("nan")
                freed.extend(blocks)
                free(blocks)
            alloc.free = poisoned_free
            for t in tensors:
                t[0] = float("nan")
        tokens = [o.token_ids for o in llm.generate(prompts, params)]
        graphs = llm.runner.graphs
        # traced with inert rows over the NaN null block: a padded row's drafts stay in range
        assert graphs is None or (graphs.trace and graphs.propose_graphs), "a decode graph failed to trace"
        drafts = [d.tolist() for d in proposed] if graphs is None else None
        return tokens, drafts, llm.stats, freed
    ref, ref_drafts, ref_stats, _ = run(False, recycle_sliding_kv=False, enforce_eager=True)
    assert ref_stats.num_accepted > 0
    for eager in (True, False):
        tokens, drafts, stats, freed = run(True, enforce_eager=eager)
        assert freed, "the sliding pool was meant to recycle blocks"
        assert tokens == ref and stats == ref_stats
        assert eager is False or drafts == ref_drafts
