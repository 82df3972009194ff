"""`mtpkit generate "def fibonacci(n):" --num-spec 3`: stream a completion, then print the
speculation stats. `--debug` checks every boundary and prints the shape trace of the run."""

import argparse
import sys
import time

DEFAULT_MODEL = "tiny-qwen3-next"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mtpkit", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a completion with MTP speculative decoding")
    g.add_argument("prompt", help="prompt text")
    g.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint directory or built-in name")
    g.add_argument("--num-spec", type=int, default=3, help="draft tokens per step (0 = no MTP)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--dtype", default="float32")
    g.add_argument("--device", default=None)
    g.add_argument("--no-stream", action="store_true", help="print the completion at the end")
    g.add_argument("--debug", action="store_true", help="check shapes and print the shape trace")
    sub.add_parser("models", help="list the built-in models")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import mtpkit
    from mtpkit.models.registry import builtin_models

    if args.command == "models":
        print("\n".join(builtin_models()) or "(none)")
        return 0
    try:
        llm = mtpkit.LLM(args.model, num_spec=args.num_spec, dtype=args.dtype, device=args.device)
        params = mtpkit.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                       top_k=args.top_k, top_p=args.top_p, seed=args.seed)
        trace = mtpkit.set_debug(True) if args.debug else None
        t0, out = time.perf_counter(), None
        for ev in llm.stream(args.prompt, params):
            out = ev.output
            if not args.no_stream and ev.delta:  # final text only: never half a character
                sys.stdout.write(ev.delta)
                sys.stdout.flush()
        elapsed = time.perf_counter() - t0
    except mtpkit.MtpkitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.no_stream:
        sys.stdout.write(out.text or " ".join(map(str, out.token_ids)))
    s = out.spec_stats
    print(f"\n\n--- {len(out.token_ids)} tokens in {elapsed:.2f} s ({len(out.token_ids) / elapsed:.1f} tok/s), "
          f"finish_reason={out.finish_reason}")
    if args.num_spec:
        rates = ", ".join(f"{r:.2f}" for r in s.acceptance_rate_per_position)
        print(f"--- num_spec={args.num_spec}: mean acceptance length {s.mean_acceptance_length:.2f} "
              f"over {s.verify_steps} verify steps; accepted {s.num_accepted}/{s.num_drafted} drafts; "
              f"acceptance per position [{rates}]")
    if trace is not None:
        print(f"\n--- shape trace ({len(trace)} checked calls; the last 40):")
        print(trace.table(last=40, args=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
