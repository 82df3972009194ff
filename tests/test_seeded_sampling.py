"""Seeded sampling: a request's tokens depend on its prompt, its SamplingParams and its seed
only; not on what else runs, on preemption (recomputation), on the step schedule, nor on
speculation (drafts only change how many tokens a step emits).

The embedded model in float64: separately built engines compute the same logits to ~1e-15,
far below what could move an exponential race between two tokens."""

import pytest
import torch

from mtpkit import LLM, SamplingParams

NAME = "tiny-qwen3-next"
F64 = dict(dtype="float64", device="cpu", max_model_len=128)
PROMPTS = [
    "def fibonacci(n):", "import os\n", "class Stack:\n    def __init__(self):", "for i in range(10):",
    "x = [", "def parse_args(argv):\n    ", "with open(path) as f:", "return sorted(",
    "try:\n    import json\nexcept ImportError:", "if __name__ == '__main__':", "    def __repr__(self):",
    "def read_lines(path, encoding='utf-8'):\n    \"\"\"Read",
]


def _params(i: int, max_tokens: int = 40) -> SamplingParams:
    """Even prompts: seeded, temperature 0.8; 1, 5, 9: random without a seed; 3, 7, 11: greedy."""
    if i % 2 == 0:
        return SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=1000 + i, ignore_eos=True)
    if i % 4 == 1:
        return SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95, ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def _run(num_spec: int, **kw):
    llm = LLM(NAME, num_spec=num_spec, **F64, **kw)
    return llm.generate(PROMPTS, [_params(i) for i in range(len(PROMPTS))]), llm


@pytest.mark.parametrize("num_spec", [0, 3])
def test_sampling_is_reproducible_under_preemption(num_spec):
    """12 prompts, half seeded, on pools that force preemption (recomputation from prompt +
    generated tokens), against an unconstrained pool: every request gives the same tokens,
    seeded ones and, with their per-request seed, unseeded random ones too."""
    free, _ = _run(num_spec)
    assert all(o.num_preemptions == 0 for o in free)
    for num_blocks in (18, 24):
        tight, _ = _run(num_spec, num_blocks=num_blocks)
        preempted = [i for i, o in enumerate(tight) if o.num_preemptions > 0]
        assert any(i % 2 == 0 for i in preempted), f"num_blocks={num_blocks}: no seeded request was preempted"
        assert any(i % 4 == 1 for i in preempted), f"num_blocks={num_blocks}: no unseeded random request was preempted"
        for i, (a, b) in enumerate(zip(free, tight)):
            assert a.token_ids == b.token_ids, (
                f"num_blocks={num_blocks}, prompt {i} ({_params(i)}), preempted {b.num_preemptions}x")


def test_sampled_output_with_drafts_equals_output_without():
    """Seeded sampling with MTP (num_spec 1 and 4, drafts accepted and rejected) gives the
    tokens of seeded sampling without it, token for token, in a different batch and order."""
    idx = [0, 2, 4, 6, 8, 10]
    settings = zip(idx, [0.8, 1.0, 0.6, 0.8, 1.2, 0.8], [0, 0, 0, 20, 0, 8], [1.0, 1.0, 0.9, 1.0, 0.95, 1.0])
    params = {i: SamplingParams(max_tokens=40, temperature=t, top_k=tk, top_p=tp, seed=7 * i + 1, ignore_eos=True)
              for i, t, tk, tp in settings}
    ref_llm = LLM(NAME, num_spec=0, **F64)
    ref = {i: o.token_ids for i, o in zip(idx, ref_llm.generate([PROMPTS[i] for i in idx], [params[i] for i in idx]))}
    for k in (1, 4):
        llm = LLM(NAME, num_spec=k, max_num_seqs=3, **F64)
        order = idx[::-1]
        prompts = [PROMPTS[i] for i in order] + [PROMPTS[1], PROMPTS[3]]       # other company
        sps = [params[i] for i in order] + [_params(1), _params(3)]
        outs = llm.generate(prompts, sps)
        for i, o in zip(order, outs):
            assert o.token_ids == ref[i], f"num_spec={k}, prompt {i}: with drafts {o.token_ids} != {ref[i]}"
        rates = llm.stats.acceptance_rate_per_position
        assert 0 < llm.stats.num_accepted < llm.stats.num_drafted, rates   # both outcomes exercised


def test_same_seed_same_tokens_in_any_batch():
    """One seeded request alone, in a batch behind others, twice in one batch, and on an engine
    with another schedule (no drafts, chunked prefill, one request at a time): same tokens."""
    sp = SamplingParams(max_tokens=32, temperature=0.9, top_p=0.95, seed=12345, ignore_eos=True)
    prompt = PROMPTS[5]
    llm = LLM(NAME, num_spec=2, **F64)
    alone = llm.generate([prompt], sp)[0].token_ids
    batch = llm.generate(PROMPTS[:4] + [prompt, prompt], [_params(i) for i in range(4)] + [sp, sp])
    assert batch[4].token_ids == batch[5].token_ids == alone
    other = LLM(NAME, num_spec=0, max_num_seqs=1, max_num_batched_tokens=8, **F64)
    assert other.generate([PROMPTS[0], prompt], [_params(0), sp])[1].token_ids == alone
    # A different seed gives different tokens (the seed is used at all).
    sp2 = SamplingParams(max_tokens=32, temperature=0.9, top_p=0.95, seed=12346, ignore_eos=True)
    assert llm.generate([prompt], sp2)[0].token_ids != alone


def test_rejection_sample_draws_per_position():
    """Unit level: the tokens a verify step emits are the draws at their positions whatever the
    drafts; a draft is accepted iff it equals that draw; the all-greedy path draws nothing."""
    import mtpkit.sampling.sampler as sampling
    from mtpkit.sampling.sampler import SamplingTensors
    from mtpkit.sampling.rejection import rejection_sample

    g = torch.Generator().manual_seed(0)
    R, B, V = 5, 4, 12
    logits = torch.randn(R, B, V, generator=g, dtype=torch.float64) * 2
    params = [SamplingParams(temperature=t, seed=s) for t, s in
              [(0.9, 1), (0.0, None), (1.3, 2), (0.7, 3), (1.0, 4)]]
    seeds = [1, None, 2, 3, 4]
    st = SamplingTensors.from_params(params, "cpu")
    starts = [7, 3, 40, 0, 100]
    # Each position alone (bundle 1, no drafts): the reference draw.
    single = torch.stack([rejection_sample(logits[:, j:j + 1], torch.zeros(R, 0, dtype=torch.int64),
                                           torch.zeros(R, dtype=torch.int64), st, seeds,
                                           [s + j for s in starts])[0][:, 0] for j in range(B)], 1)
    limit = torch.full((R,), B - 1, dtype=torch.int64)
    for trial in range(20):
        drafts = torch.where(torch.rand(R, B - 1, generator=g) < 0.7, single[:, :B - 1],
                             torch.randint(0, V, (R, B - 1), generator=g))
        tokens, n_emit = rejection_sample(logits, drafts, limit, st, seeds, starts)
        for i in range(R):
            n = int(n_emit[i])
            assert tokens[i, :n].tolist() == single[i, :n].tolist()
            agree = (drafts[i] == single[i, :B - 1]).long().cumprod(0).sum()
            assert n == int(agree) + 1
    # The same start position draws the same tokens again.
    again = rejection_sample(logits[:, :1], torch.zeros(R, 0, dtype=torch.int64), torch.zeros(R, dtype=torch.int64),
                             st, seeds, starts)[0][:, 0]
    assert again.tolist() == single[:, 0].tolist()
    # All greedy: argmax, and no noise is generated.
    greedy = SamplingTensors.from_params([SamplingParams()] * R, "cpu")
    orig = sampling.exponential_noise
    sampling.exponential_noise = None          # any call would fail
    try:
        tokens, n_emit = rejection_sample(logits, logits.argmax(-1)[:, :B - 1], limit, greedy, [None] * R, starts)
    finally:
        sampling.exponential_noise = orig
    assert tokens.tolist() == logits.argmax(-1).tolist() and n_emit.tolist() == [B] * R


def test_noise_is_splitmix64_of_seed_and_position():
    """The tensor hash equals splitmix64 in Python integers (int64 wrap-around, logical shifts),
    keys differ across positions and seeds, and E is Exp(1) (mean, variance, P(E > 1))."""
    import math

    from mtpkit.sampling.sampler import _MASK, _mix64, exponential_noise, noise_keys

    seeds, pos = [5, -3, 2**64 - 1, 1 << 70], torch.tensor([[0, 1], [17, 18], [4095, 4096], [3, 4]])
    keys = noise_keys(seeds, pos)
    E = exponential_noise(keys, 6)
    for r, s in enumerate(seeds):
        for j in range(2):
            key = _mix64(_mix64(s & _MASK) ^ int(pos[r, j]))
            assert int(keys[r, j]) & _MASK == key
            want = [-math.log(((_mix64((key + i * 0x9E3779B97F4A7C15) & _MASK) >> 11) + 0.5) * 2.0 ** -53)
                    for i in range(6)]
            assert E[r, j].tolist() == pytest.approx(want, rel=1e-15)
    many = noise_keys(list(range(64)), torch.arange(64)[None, :].expand(64, 64).contiguous())
    assert many.unique().numel() == 64 * 64
    E = exponential_noise(many, 257)
    assert abs(E.mean().item() - 1) < 0.01 and abs(E.var().item() - 1) < 0.03
    assert abs((E > 1).double().mean().item() - math.exp(-1)) < 0.005
