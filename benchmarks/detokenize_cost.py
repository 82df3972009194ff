"""Host time a stream spends detokenizing, per event, as its output grows: the windowed
detokenizer (mtpkit/text/detokenize.py, what LLM.stream runs: one IncrementalDetokenizer.add
per event, whose decoded text the event's RequestOutput reuses) against decoding the whole
output twice per event (what a stream did before: the detokenizer's and the RequestOutput's
text), in the same process on the same ids.

    python benchmarks/detokenize_cost.py
    python benchmarks/detokenize_cost.py --model tiny-gemma4 --lengths 512 4096 --tokens-per-event 1
"""

import argparse
import time

from mtpkit import LLM
from mtpkit.text.detokenize import IncrementalDetokenizer
from mtpkit.text.stop_strings import cut_at_stop

TEXT = ("def fibonacci(n):\n    # the n-th number, 中文 comments ü\n    a, b = 0, 1\n    for _ in range(n):\n"
        "        a, b = b, a + b\n    return a\n\n")


def windowed(tok, ids, step, stop):
    d = IncrementalDetokenizer(tok, stop=stop)
    for i in range(0, len(ids), step):
        d.add(ids[i:i + step], final=i + step >= len(ids))
        cut_at_stop(d.decoded, stop)
    return d.text


def whole(tok, ids, step, stop):
    text = ""
    for i in range(0, len(ids), step):
        text = cut_at_stop(tok.decode(ids[:i + step]), stop)   # the detokenizer's decode
        cut_at_stop(tok.decode(ids[:i + step]), stop)          # the RequestOutput's
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-qwen3-next")
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--tokens-per-event", type=int, default=4, help="tokens a verify step emits (num_spec 3: ~3.7)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with LLM(args.model, enforce_eager=True, max_model_len=64) as llm:
        tok = llm.tokenizer
    base = tok.encode(TEXT * 200).ids
    stop = ["<|never|>"]
    print(f"model={args.model} tokens/event={args.tokens_per_event}, medians of {args.rounds} rounds")
    print(f"{'output tokens':>14} {'whole decode us/event':>22} {'windowed us/event':>18} {'whole / windowed':>17}")
    for n in args.lengths:
        ids = (base * (n // len(base) + 1))[:n]
        events = -(-n // args.tokens_per_event)
        times = {"whole": [], "windowed": []}
        for _ in range(args.rounds):
            for name, fn in (("whole", whole), ("windowed", windowed)):
                t = time.perf_counter()
                text = fn(tok, ids, args.tokens_per_event, stop)
                times[name].append((time.perf_counter() - t) / events * 1e6)
                assert text == tok.decode(ids), name
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        print(f"{n:>14} {med['whole']:>22.1f} {med['windowed']:>18.1f} {med['whole'] / med['windowed']:>16.1f}x")


if __name__ == "__main__":
    main()
