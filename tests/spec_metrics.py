"""What speculative-decoding tests of every drafter compute: the exact metrics of an
all-accept or all-reject run, and the chi-square test of the token drawn through the accept
test against the target's own distribution."""

import torch

from mtpkit import LLM, SamplingParams

F64 = dict(dtype="float64", device="cpu")


def expected_steps(max_tokens: int, k: int, accept_all: bool):
    """Verify steps, drafts and accepted drafts for one request (the prefill emits the first token)."""
    left, steps, accepted, drafted = max_tokens - 1, 0, 0, 0
    while left > 0:
        limit = min(k, left - 1)
        emit = limit + 1 if accept_all else 1
        steps, drafted, accepted = steps + 1, drafted + limit, accepted + (limit if accept_all else 0)
        left -= emit
    return steps, drafted, accepted


def chi2_pvalue(counts: torch.Tensor, expected_p: torch.Tensor) -> float:
    n = counts.sum()
    keep = expected_p * n >= 5            # pool rare cells so the chi-square approximation holds
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]]).double()
    exp = torch.cat([expected_p[keep], expected_p[~keep].sum()[None]]).double() * n
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def second_token_distribution(path, prompt, params, k, n, **llm_kw):
    """Counts of the second generated token over n seeded requests (and the engine)."""
    llm = LLM(path, num_spec=k, max_num_seqs=64, **F64, **llm_kw)
    # max_tokens=3: the verify step may accept d1, so token 2 goes through the accept test.
    sps = [SamplingParams(max_tokens=3, ignore_eos=True, temperature=params["temperature"],
                          top_k=params.get("top_k", 0), top_p=params.get("top_p", 1.0), seed=i)
           for i in range(n)]
    outs = llm.generate([prompt] * n, sps)
    V = llm.model_config.vocab_size
    return torch.bincount(torch.tensor([o.token_ids[1] for o in outs]), minlength=V), llm


def exact_second_token_p(path, prompt, params, **llm_kw):
    """The target's own distribution of the second token (sum over the first)."""
    from mtpkit.sampling.sampler import SamplingTensors, target_probs
    llm = LLM(path, **F64, **llm_kw)
    sp = SamplingParams(max_tokens=2, temperature=params["temperature"], top_k=params.get("top_k", 0),
                        top_p=params.get("top_p", 1.0))
    st_ = SamplingTensors.from_params([sp], "cpu")

    def p_next(ids):
        return target_probs(llm.score(ids)[-1][None, None], st_)[0, 0].double()
    p1 = p_next(prompt)
    return sum(p1[t] * p_next(prompt + [t]) for t in range(len(p1)) if p1[t] > 0)
