"""Prefix caching on vs off, in one run, on the embedded models (CPU, fp32): two LLMs per model
(enable_prefix_caching True / False), the same requests on both, alternated in rounds; the
outputs are checked equal token for token.

- shared prefix: 16 requests whose prompts share a 1,500-token prefix (each its own 16-token
  tail), one after the other: time to first token (the first request fills the cache; the
  median of the 15 others is the hit's) and the total of the 16 (max_tokens each);
- 5-turn chat: a conversation growing by a user message and the reply each turn (llm.chat's
  ids; the previous turn's prompt and reply are the next's prefix): TTFT of turns 2..5 and
  the total;
- no reuse: 16 prompts of 500 random tokens sharing nothing, in one generate call: the total,
  on / off (the cost of hashing, keying and, with recurrent state, the snapshot chunks).

Prints each time and the ratios off / on (> 1: caching faster) and, for no reuse, on / off.

    python benchmarks/prefix_cache.py [--rounds 3] [--max-tokens 16] [--num-spec 3]
                                      [--snapshot-interval N]   # prefix_snapshot_interval of the "on" LLM
"""

import argparse
import random
import statistics
import time

from mtpkit import LLM, SamplingParams

MODELS = {"tiny-qwen3-next": {}, "tiny-gemma4": {"draft_model": "tiny-gemma4-assistant"}}


def ttft(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[float, float, list[int]]:
    """(seconds to the first token, seconds to the end, tokens) of one request."""
    t0, first, tokens = time.perf_counter(), None, []
    for ev in llm.stream([prompt], params):
        if ev.new_token_ids and first is None:
            first = time.perf_counter() - t0
        tokens.extend(ev.new_token_ids)
    return first, time.perf_counter() - t0, tokens


def shared_prefix(llm: LLM, params: SamplingParams, seed: int) -> dict:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 200) for _ in range(1500)]
    llm.reset_prefix_cache()
    firsts, tokens, t0 = [], [], time.perf_counter()
    for i in range(16):
        f, _, toks = ttft(llm, prefix + [rng.randrange(3, 200) for _ in range(16)], params)
        firsts.append(f), tokens.append(toks)
    return {"cold_ttft": firsts[0], "hit_ttft": statistics.median(firsts[1:]), "total": time.perf_counter() - t0,
            "tokens": tokens}


def chat(llm: LLM, params: SamplingParams) -> dict:
    llm.reset_prefix_cache()
    msgs, firsts, tokens, t0 = [], [], [], time.perf_counter()
    for turn in range(5):
        msgs.append({"role": "user", "content": f"Turn {turn}. Here is some text to think about: "
                     + " ".join(f"word{(turn * 31 + j) % 97}" for j in range(20))})
        ids = llm.apply_chat_template(msgs)[0]
        f, _, toks = ttft(llm, ids, params)
        firsts.append(f), tokens.append(toks)
        msgs.append({"role": "assistant", "content": llm.tokenizer.decode(toks)})
    return {"ttft": statistics.median(firsts[1:]), "total": time.perf_counter() - t0, "tokens": tokens}


def no_reuse(llm: LLM, params: SamplingParams, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 200) for _ in range(500)] for _ in range(16)]
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return {"total": time.perf_counter() - t0, "tokens": [o.token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--num-spec", type=int, default=3)
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--snapshot-interval", type=int, default=None,
                    help="prefix_snapshot_interval of the caching LLM (recurrent state; default the engine's)")
    args = ap.parse_args()
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    for name in args.models:
        interval = {"prefix_snapshot_interval": args.snapshot_interval} if args.snapshot_interval else {}
        llms = {on: LLM(name, num_spec=args.num_spec, enable_prefix_caching=on, max_model_len=2048, dtype="float32",
                        device="cpu", **MODELS[name], **(interval if on else {})) for on in (True, False)}
        res = {on: {"shared": [], "chat": [], "none": []} for on in llms}
        for rnd in range(args.rounds):
            for on in ((True, False) if rnd % 2 == 0 else (False, True)):   # alternate who goes first
                llm = llms[on]
                res[on]["shared"].append(shared_prefix(llm, params, seed=rnd))
                res[on]["chat"].append(chat(llm, params))
                res[on]["none"].append(no_reuse(llm, params, seed=100 + rnd))
        for kind in ("shared", "chat", "none"):   # caching never changes what is generated
            for a, b in zip(res[True][kind], res[False][kind]):
                assert a["tokens"] == b["tokens"], f"{name} {kind}: outputs differ with caching"

        def med(on, kind, key):
            return statistics.median(r[key] for r in res[on][kind])
        stats = llms[True].stats.prefix_cache
        print(f"{name} (num_spec={args.num_spec}, max_tokens={args.max_tokens}, {args.rounds} rounds, medians; "
              f"snapshot interval {llms[True].engine.prefix_snapshot_interval}; "
              f"outputs equal on/off)")
        s_on, s_off = med(True, "shared", "hit_ttft"), med(False, "shared", "hit_ttft")
        print(f"  16 x 1,500-token shared prefix: TTFT of a hit {s_on * 1e3:.1f} ms on, {s_off * 1e3:.1f} ms off: "
              f"x{s_off / s_on:.2f}; first (cold) {med(True, 'shared', 'cold_ttft') * 1e3:.1f} / "
              f"{med(False, 'shared', 'cold_ttft') * 1e3:.1f} ms; total {med(True, 'shared', 'total'):.2f} s on, "
              f"{med(False, 'shared', 'total'):.2f} s off: x{med(False, 'shared', 'total') / med(True, 'shared', 'total'):.2f}")
        c_on, c_off = med(True, "chat", "ttft"), med(False, "chat", "ttft")
        print(f"  5-turn chat: TTFT of turns 2-5 {c_on * 1e3:.1f} ms on, {c_off * 1e3:.1f} ms off: x{c_off / c_on:.2f}; "
              f"total {med(True, 'chat', 'total'):.2f} s on, {med(False, 'chat', 'total'):.2f} s off: "
              f"x{med(False, 'chat', 'total') / med(True, 'chat', 'total'):.2f}")
        n_on, n_off = med(True, "none", "total"), med(False, "none", "total")
        print(f"  no reuse (16 x 500 distinct tokens): total {n_on:.2f} s on, {n_off:.2f} s off: cost on/off "
              f"x{n_on / n_off:.3f}")
        print(f"  {stats}")
        for llm in llms.values():
            llm.close()


if __name__ == "__main__":
    main()
