"""`mtpkit generate "def fibonacci(n):" --num-spec 3`: stream a completion, then print the
speculation stats. `--debug` checks every boundary and prints the shape trace of the run."""

import argparse
import sys
import time

from .sampling import MAX_SEED

DEFAULT_MODEL = "tiny-qwen3-next"


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows every option's default; keeps the description's line breaks."""


def _seed(value: str) -> int:
    try:
        seed = int(value)
    except ValueError:
        seed = None
    if seed is None or not 0 <= seed <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"{value!r} is not an int between 0 and 2**64-1")
    return seed


def _int_at_least(lo: int):
    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            n = None
        if n is None or n < lo:
            raise argparse.ArgumentTypeError(f"{value!r} is not an int >= {lo}")
        return n
    return parse


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mtpkit", description=__doc__, formatter_class=_Formatter)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a completion with speculative decoding",
                       description="Stream a completion of PROMPT, then print the speculation stats.",
                       formatter_class=_Formatter)
    g.add_argument("prompt", help="prompt text")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="checkpoint directory, built-in name (`mtpkit models` lists them) or Hugging Face hub "
                        "repo id (downloaded, or read from the HF cache with HF_HUB_OFFLINE=1)")
    g.add_argument("--num-spec", type=_int_at_least(0), default=3, help="draft tokens per step (0 = no speculation)")
    g.add_argument("--draft-model", default=None,
                   help="checkpoint directory or built-in name of a separate drafter (default: the model's own, "
                        "e.g. Qwen3-Next's MTP head)")
    g.add_argument("--max-tokens", type=_int_at_least(1), default=128, help="tokens to generate at most")
    g.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="stop when the text contains STR (not printed); repeat for several")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    g.add_argument("--top-k", type=_int_at_least(0), default=0, help="sample from the k likeliest tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1 = off)")
    g.add_argument("--seed", type=_seed, default=None,
                   help="sampling seed, 0..2**64-1 (None: derived from the engine seed)")
    g.add_argument("--dtype", default="float32",
                   help="float32, bfloat16, float64 (CPU), float16 (CUDA) or auto (float32 on CPU, the "
                        "checkpoint's dtype on CUDA)")
    g.add_argument("--device", default=None, help="cpu, cuda or cuda:N (None: CUDA when a GPU is present, else CPU)")
    g.add_argument("--no-stream", action="store_true", help="print the completion at the end")
    g.add_argument("--debug", action="store_true", help="check shapes and print the shape trace")
    sub.add_parser("models", help="list the built-in models", formatter_class=_Formatter)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out = None
    import mtpkit
    from mtpkit.models.registry import builtin_models

    if args.command == "models":
        print("\n".join(builtin_models()) or "(none)")
        return 0
    try:
        llm = mtpkit.LLM(args.model, num_spec=args.num_spec, draft_model=args.draft_model, dtype=args.dtype,
                         device=args.device)
        params = mtpkit.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                       top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop)
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
    except KeyboardInterrupt:  # Ctrl-C: what was generated, one line saying so, no traceback
        n = len(out.token_ids) if out is not None else 0
        if args.no_stream and out is not None:
            sys.stdout.write(out.text or " ".join(map(str, out.token_ids)))
        sys.stdout.write("\n")
        sys.stdout.flush()
        print(f"--- interrupted (Ctrl-C) after {n} tokens", file=sys.stderr)
        return 130
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
