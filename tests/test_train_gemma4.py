"""training.gemma4_*: tiny-gemma4's training models against transformers 5.24, the losses
they train, the speculative-loop simulation, and a few steps of each stage on a tiny slice.

The models are small random ones (windows shorter than the sequences); the shipped pair is
tested in tests/test_embedded_gemma4.py.
"""

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import oracle as O  # noqa: E402

pytest.importorskip("transformers")

from mtpkit.models.gemma4.config import FULL as F, SLIDING as S  # noqa: E402
from training import gemma4_assistant as A  # noqa: E402
from training import gemma4_assistant_io as AIO  # noqa: E402
from training import gemma4_target as T  # noqa: E402
from training.gemma4_spec_sim import forward, speculate  # noqa: E402

WINDOW = 8
TINY = dict(T.SIZES["l6-h256"], hidden_size=64, intermediate_size=96, num_hidden_layers=3, layer_types=[S, S, F],
            sliding_window=WINDOW, head_dim=16, global_head_dim=32)
ASST = dict(hidden_size=64, intermediate_size=96, layer_types=[S, F], num_attention_heads=4)
ORDERED = {"num_centroids": 16, "centroid_intermediate_top_k": 4}


def _perturbed_target(seed=0):
    """A tiny random target, norms / layer scalars away from 1 and logits far from uniform."""
    m = T.build_model(T.mtpkit_config(TINY), seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, p in m.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.1 if p.ndim == 1 else 0.05))
        m.embed_tokens.mul_(4.0)
    return m


def _perturbed_assistant(tgt, ordered=None, seed=0):
    c = A.AssistantConfig.from_dict(AIO.hf_config(TINY, ASST, ordered).to_dict())
    a = AIO.build_assistant(c, tgt, seed)
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for _, p in a.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
        if ordered:
            a.token_ordering.copy_(torch.randperm(c.vocab_size, generator=g))
    return a


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target, its directory, {None: plain assistant, "ordered": ...}, their directories)."""
    root = tmp_path_factory.mktemp("g4train")
    tgt = _perturbed_target()
    T.export_checkpoint(tgt, TINY, root / "target", torch.float32)
    assistants, dirs = {}, {}
    for key, ordered in (("plain", None), ("ordered", ORDERED)):
        assistants[key] = _perturbed_assistant(tgt, ordered)
        dirs[key] = AIO.export_checkpoint(assistants[key], TINY, ASST, tgt, root / key, torch.float32)
    return tgt, root / "target", assistants, dirs


def test_target_logits_and_gradients_match_transformers(pair):
    from transformers import Gemma4ForCausalLM

    tgt, path, _, _ = pair
    hf = Gemma4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    batch = torch.randint(0, 257, (2, 41), generator=torch.Generator().manual_seed(3))   # 40 > window 8
    tgt.zero_grad()
    T.ntp_loss(tgt, batch).backward()
    logits = hf(input_ids=batch[:, :-1], use_cache=False).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).backward()
    with torch.no_grad():
        _, ours, _ = T.run_target(tgt, batch[:, :-1])
    torch.testing.assert_close(ours, logits.flatten(0, 1), rtol=1e-5, atol=1e-5)
    # gradients under transformers' names: a copy of the model holding its gradients, exported
    import copy
    from mtpkit.checkpoint.loader import export_state_dict
    grads = copy.deepcopy(tgt)
    with torch.no_grad():
        for (_, gp), (_, p) in zip(grads.named_parameters(), tgt.named_parameters()):
            gp.copy_(p.grad)
    theirs = dict(hf.named_parameters())
    compared = 0
    for name, g in export_state_dict(grads).items():
        if name.endswith("layer_scalar"):
            continue        # a buffer in transformers (trained here)
        want = theirs[name].grad
        assert (g - want).norm() <= 1e-4 * want.norm(), name
        compared += 1
    assert compared == len(theirs)


@pytest.mark.parametrize("kind", ["plain", "ordered"])
def test_assistant_drafts_match_transformers(pair, kind):
    """The training model's rounds = transformers' own drafter loop
    (SinglePositionMultiTokenCandidateGenerator) after a prefill longer than the window."""
    from transformers import Gemma4AssistantForCausalLM, Gemma4ForCausalLM, GenerationConfig
    from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator

    tgt, tpath, assistants, dirs = pair
    asst = assistants[kind]
    hft = Gemma4ForCausalLM.from_pretrained(tpath, dtype=torch.float32).eval()
    hfa, info = Gemma4AssistantForCausalLM.from_pretrained(dirs[kind], dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    n, k = 30, 5
    prompt = torch.randint(0, 257, (1, n), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = hft(input_ids=prompt, output_hidden_states=True, return_shared_kv_states=True)
        ids = torch.cat([prompt, out.logits[:, -1:].argmax(-1)], 1)
        gen = SinglePositionMultiTokenCandidateGenerator(hfa.eval(), hft.get_input_embeddings(),
                                                         GenerationConfig(max_length=100))
        gen.num_assistant_tokens = k
        cand, cand_logits = gen.get_candidates(ids, {"attention_mask": torch.ones_like(ids)}, out, False, 0)
        hidden, _, cache = T.run_target(tgt, ids)
        p = torch.tensor([[n]])
        h, kv, masks = A.rounds_input(tgt, hidden, cache, 1, n + 1, p)
        tok, logits, drafts = ids[:, n:], [], []
        for _ in range(k):
            d, h = asst.step(tgt.embed(tok.reshape(-1)).view(1, 1, -1), h, p, kv, masks)
            logits.append(asst.draft_logits(d)[0])
            tok = logits[-1].argmax(-1, keepdim=True)
            drafts.append(int(tok))
    assert drafts == cand[0, n + 1:].tolist()
    torch.testing.assert_close(torch.cat(logits), cand_logits[0], rtol=1e-4, atol=1e-4)


def test_round_mask_reads_the_last_window_plus_one_keys():
    m = A.round_mask(torch.tensor([[10, 3]]), 12, 4)[0]
    assert m[0].nonzero().flatten().tolist() == [5, 6, 7, 8, 9]          # p-W-1 .. p-1
    assert m[1].nonzero().flatten().tolist() == [0, 1, 2]
    assert A.round_mask(torch.tensor([[10]]), 12, None)[0, 0].nonzero().flatten().tolist() == list(range(10))


def test_draft_losses_score_each_round_as_run_alone(pair):
    """The batched, teacher-forced loss of step k = the mean over rounds p = 1..T-k of each
    round run on its own (one query), data and distillation parts both."""
    tgt, _, assistants, _ = pair
    asst = assistants["plain"]
    T_, depth = 20, 3
    batch = torch.randint(0, 257, (2, T_ + depth), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        for distill in (0.0, 1.0):
            got = A.draft_losses(asst, tgt, batch, T_, depth, distill, None, None)
            hidden, tlogits, cache = T.run_target(tgt, batch[:, :T_])
            soft = torch.softmax(tlogits.view(2, T_, -1), -1)
            want = [[] for _ in range(depth)]
            for b in range(2):
                for p0 in range(1, T_):
                    p = torch.tensor([[p0]])
                    hb, kvb, masks = A.rounds_input(tgt, hidden[b * T_:(b + 1) * T_], _one(cache, b), 1, T_, p)
                    for k in range(1, depth + 1):
                        e = tgt.embed(batch[b, p0 + k - 1].view(1)).view(1, 1, -1)
                        d, hb = asst.step(e, hb, p, kvb, masks)
                        if p0 + k - 1 > T_ - 1:
                            continue
                        logp = torch.log_softmax(asst.logits(d)[0, 0], -1)
                        if distill:
                            want[k - 1].append(-(soft[b, p0 + k - 1] * logp).sum())
                        else:
                            want[k - 1].append(-logp[batch[b, p0 + k]])
            for k in range(depth):
                torch.testing.assert_close(got[k], torch.stack(want[k]).mean(), rtol=1e-5, atol=1e-6)


def _one(cache, b):
    """The cache of request b alone (in block 1)."""
    from mtpkit.step.cache import CacheTensors
    kv = {g: [(k[[0, b + 1]], v[[0, b + 1]]) for k, v in layers] for g, layers in cache.kv.items()}
    return CacheTensors(kv, cache.state, cache.block_size)


def test_speculate_is_lossless_and_counts_rounds(pair):
    tgt, _, assistants, _ = pair
    prompts = [torch.randint(0, 257, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 23)]
    plain, _ = speculate(tgt, None, prompts, 14, 0)
    # plain decoding = the argmax of a full forward, token by token
    seqs = [list(p) for p in prompts]
    for _ in range(14):
        _, logits, _, starts, _ = forward(tgt, seqs)
        for i, s in enumerate(seqs):
            s.append(int(logits[starts[i] + len(s) - 1].argmax()))
    assert plain == [s[len(p):] for s, p in zip(seqs, prompts)]
    for kind in ("plain", "ordered"):
        for k in (1, 3):
            out, st = speculate(tgt, assistants[kind], prompts, 14, k)
            assert out == plain, (kind, k)
            # every round emits accepted + 1 tokens; 13 per prompt after the prefill's first
            assert st.rounds + st.sampled_accepted == 2 * 13 and st.accepted == st.sampled_accepted
    # sampling: a seeded run is reproducible and its expected acceptance is a probability
    a1 = speculate(tgt, assistants["plain"], prompts, 14, 3, temperature=0.7, seed=1)
    a2 = speculate(tgt, assistants["plain"], prompts, 14, 3, temperature=0.7, seed=1)
    assert a1[0] == a2[0] and 1.0 <= a1[1].mean_acceptance_length <= 4.0


def test_stages_run_a_few_steps(tmp_path):
    """target -> assistant -> centroids, a few steps each on tiny windows, each export loading
    in transformers (and the target in mtpkit)."""
    from transformers import Gemma4AssistantForCausalLM, Gemma4ForCausalLM

    from mtpkit import LLM, SamplingParams
    from training import gemma4_train as GT

    common = ["--steps", "2", "--warmup", "1", "--batch", "2", "--seq-len", "24", "--eval-windows", "2",
              "--save-every", "1"]
    tdir, adir, cdir = tmp_path / "t", tmp_path / "a", tmp_path / "c"
    threads = torch.get_num_threads()
    try:
        GT.main(["target", *common, "--work-dir", str(tmp_path / "tw"), "--out-dir", str(tdir)])
        GT.main(["assistant", *common, "--queries", "6", "--target", str(tdir), "--work-dir", str(tmp_path / "aw"),
                 "--out-dir", str(adir), "--generated-prompts", "3", "--generated-tokens", "8"])
        before = (adir / "model.safetensors").read_bytes()
        GT.main(["centroids", *common, "--queries", "6", "--target", str(tdir), "--init-from", str(adir),
                 "--work-dir", str(tmp_path / "cw"), "--out-dir", str(cdir),
                 "--generated-file", str(tmp_path / "aw" / "generated.pt")])
    finally:
        torch.set_num_threads(threads)     # the stages set their own
    assert (adir / "model.safetensors").read_bytes() == before
    for work, cols in (("tw", ["ntp"]), ("aw", [f"step{k}" for k in range(1, 7)]), ("cw", ["ce", "recall"])):
        header, *rows = (tmp_path / work / "loss.tsv").read_text().splitlines()
        assert header.split("\t")[4:-2] == cols and len(rows) == 2
    assert json.loads((tdir / "mtpkit.json").read_text()) == {"default_drafter": "tiny-gemma4-assistant"}
    for d in (adir, cdir):
        _, info = Gemma4AssistantForCausalLM.from_pretrained(d, output_loading_info=True)
        assert not any(info.values()), info
    hf = Gemma4ForCausalLM.from_pretrained(tdir, dtype=torch.float32)
    ids = [ord(c) for c in "def f(x):\n"]
    out = LLM(tdir, dtype="float32", enforce_eager=True).generate([ids], SamplingParams(max_tokens=8, ignore_eos=True))
    assert O.check_greedy_against_hf(hf, ids, out[0].token_ids).ok
    # half of each assistant batch came from the target's own greedy continuations (made once)
    gen = torch.load(tmp_path / "aw" / "generated.pt")
    assert gen.shape == (3, 64 + 8)
    assert all(O.check_greedy_against_hf(hf, row[:64], row[64:]).ok for row in gen.tolist())
    # the centroid stage trained only the centroids; the ordering is a permutation
    from safetensors.torch import load_file
    plain, cen = load_file(str(adir / "model.safetensors")), load_file(str(cdir / "model.safetensors"))
    assert all(torch.equal(plain[n], cen[n]) for n in plain)
    order = cen["masked_embedding.token_ordering"]
    assert sorted(order.tolist()) == list(range(T.VOCAB_SIZE))
