"""`mtpkit generate "def fibonacci(n):" --num-spec 3`: stream a completion, then print the
speculation stats. `mtpkit serve MODEL`: an OpenAI-compatible HTTP server (the `serve` extra). Several prompts run as one batch (each completion printed under its prompt's
number); `-` reads a prompt from standard input. `--debug` checks every boundary and prints the
shape trace of the run.
Memory: `--gpu-memory-utilization 0.9` (CUDA) or `--memory-budget 64GiB` size the caches from
what the weights and activations leave (the plan is printed); `--fp8-weights` keeps or
dequantizes an FP8 checkpoint's weights.
Structured outputs: `--json-schema FILE` (a JSON schema), `--regex RE` or `--choice A B ...`
constrain every completion to that format (speculation included)."""

import argparse
import os
import re
import sys
import time

from mtpkit.engine.args import COMPILE_MODES
from mtpkit.sampling.params import MAX_SEED

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


_UNITS = {"": 1, "b": 1, "k": 10 ** 3, "kb": 10 ** 3, "m": 10 ** 6, "mb": 10 ** 6, "g": 10 ** 9, "gb": 10 ** 9,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "t": 10 ** 12, "tb": 10 ** 12}


def byte_count(value: str) -> int:
    """A positive byte count: an int, or a number with a unit (512MiB, 8GiB, 1.5GB; K/M/G are
    powers of 1000, KiB/MiB/GiB of 1024)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", value)
    unit = m and m.group(2).lower()
    if not m or unit not in _UNITS or int(float(m.group(1)) * _UNITS[unit]) < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive byte count (e.g. 68719476736, 64GiB, 1.5GB)")
    return int(float(m.group(1)) * _UNITS[unit])


def utilization(value: str) -> float:
    try:
        u = float(value)
    except ValueError:
        u = None
    if u is None or not 0 < u <= 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number in (0, 1]")
    return u


FP8_WEIGHTS = {"auto": None, "keep": True, "dequantize": False}


def add_memory_options(p: argparse.ArgumentParser) -> None:
    """The LLM constructor's memory options (shared with examples/serve_batch.py)."""
    m = p.add_argument_group("memory", "how the KV and state pools are sized (give a budget, or explicit sizes, "
                                       "or neither: enough for the workload)")
    m.add_argument("--gpu-memory-utilization", type=utilization, default=None, metavar="U",
                   help="share of the GPU's memory the engine may use, in (0, 1] (CUDA): weights, activations "
                        "(measured by a profile run), then the state and KV pools")
    m.add_argument("--memory-budget", type=byte_count, default=None, metavar="BYTES",
                   help="bytes the engine may use on its device (any device), e.g. 64GiB")
    m.add_argument("--kv-cache-memory", type=byte_count, default=None, metavar="BYTES", help="bytes of the KV pool")
    m.add_argument("--state-cache-memory", type=byte_count, default=None, metavar="BYTES",
                   help="bytes of the recurrent-state pool")
    m.add_argument("--num-blocks", type=_int_at_least(2), default=None,
                   help="KV blocks in the pool (the null block included)")
    m.add_argument("--num-state-slots", type=_int_at_least(2), default=None,
                   help="recurrent-state slots (the null slot included)")
    m.add_argument("--fp8-weights", choices=list(FP8_WEIGHTS), default="auto",
                   help="FP8 checkpoints: keep the FP8 weights and run the block-scaled FP8 matmul, or dequantize "
                        "them at load (auto: keep on CUDA, dequantize elsewhere)")
    p.add_argument("--compile", choices=COMPILE_MODES, default=None,
                   help="CPU: compile the decode graphs that serve many steps (inductor; freeze: frozen weights, "
                        "minutes per graph; aot: AOTInductor packages cached in ~/.cache/mtpkit/aot; aot-tuned: "
                        "those packages with freeze's GEMMs, the fastest, minutes per graph cold). "
                        "Default: TorchScript traces, an engine starts in seconds")
    p.add_argument("--draft-dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="CPU: the dtype the drafter (MTP head, Gemma 4 assistant) runs in; bfloat16 beside a float32 "
                        "target generates the same text and reads half the bytes per draft pass: faster with "
                        "--compile aot-tuned on CPUs with bfloat16 arithmetic, slower without --compile "
                        "(auto: the target's)")
    p.add_argument("--num-scheduler-steps", type=int, default=1, metavar="N",
                   help="CPU, --num-spec 0: up to N decode steps per scheduling (the decode graph replayed N "
                        "times in a row; the host's work around a step paid once per N tokens; the same text, "
                        "streamed N tokens at a time)")


def memory_kwargs(args) -> dict:
    """The LLM keyword arguments of add_memory_options' flags."""
    return dict(gpu_memory_utilization=args.gpu_memory_utilization, memory_budget=args.memory_budget,
                kv_cache_memory=args.kv_cache_memory, state_cache_memory=args.state_cache_memory,
                num_blocks=args.num_blocks, num_state_slots=args.num_state_slots,
                keep_fp8=FP8_WEIGHTS[args.fp8_weights], compile=getattr(args, "compile", None),
                draft_dtype=getattr(args, "draft_dtype", "auto"),
                num_scheduler_steps=getattr(args, "num_scheduler_steps", 1))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mtpkit", description=__doc__, formatter_class=_Formatter)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a completion with speculative decoding",
                       description="Stream a completion of PROMPT, then print the speculation stats.",
                       formatter_class=_Formatter)
    g.add_argument("prompts", nargs="+", metavar="PROMPT",
                   help="prompt text; several run as one batch; - reads a prompt from standard input")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="checkpoint directory, built-in name (`mtpkit models` lists them) or Hugging Face hub "
                        "repo id (downloaded, or read from the HF cache with HF_HUB_OFFLINE=1)")
    g.add_argument("--num-spec", type=_int_at_least(0), default=3, help="draft tokens per step (0 = no speculation)")
    g.add_argument("--draft-model", default=None,
                   help="checkpoint directory or built-in name of a separate drafter (default: the model's own, "
                        "e.g. Qwen3-Next's MTP head, or the one its checkpoint names: tiny-gemma4's assistant)")
    g.add_argument("--max-tokens", type=_int_at_least(1), default=128, help="tokens to generate at most")
    g.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="stop when the text contains STR (not printed); repeat for several")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    g.add_argument("--top-k", type=_int_at_least(0), default=0, help="sample from the k likeliest tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1 = off)")
    g.add_argument("--logprobs", type=_int_at_least(0), default=None, metavar="N",
                   help="after the completion, print each generated token's logprob and rank and the N likeliest "
                        "tokens at its position (the model's raw distribution)")
    g.add_argument("--n", type=_int_at_least(1), default=1,
                   help="samples per prompt (needs --temperature > 0), each printed; sample i uses seed + i")
    g.add_argument("--min-p", type=float, default=None,
                   help="drop tokens less likely than MIN_P x the likeliest, in [0, 1] (default: the checkpoint's "
                        "generation_config.json, else 0 = off)")
    g.add_argument("--repetition-penalty", type=float, default=None,
                   help="divide (multiply, if negative) the logits of prompt and output tokens by this, > 0 "
                        "(default: the checkpoint's generation_config.json, else 1 = off)")
    g.add_argument("--presence-penalty", type=float, default=None,
                   help="subtract this from the logits of tokens already generated, in [-2, 2] (default: the "
                        "checkpoint's generation_config.json, else 0 = off)")
    g.add_argument("--frequency-penalty", type=float, default=None,
                   help="subtract this times a token's count in the output from its logit, in [-2, 2] (default: "
                        "the checkpoint's generation_config.json, else 0 = off)")
    g.add_argument("--seed", type=_seed, default=None,
                   help="sampling seed, 0..2**64-1 (None: derived from the engine seed)")
    g.add_argument("--dtype", default="auto",
                   help="float32, bfloat16, float64 (CPU), float16 (CUDA) or auto (float32 on CPU, the "
                        "checkpoint's dtype on CUDA)")
    g.add_argument("--device", default=None, help="cpu, cuda or cuda:N (None: CUDA when a GPU is present, else CPU)")
    g.add_argument("--no-stream", action="store_true", help="print the completion at the end")
    g.add_argument("--debug", action="store_true", help="check shapes and print the shape trace")
    g.add_argument("--max-model-len", type=_int_at_least(2), default=None,
                   help="longest sequence, prompt and completion (None: the model's, at most 4096)")
    g.add_argument("--max-num-seqs", type=_int_at_least(1), default=8,
                   help="requests decoded together at most (the caches are sized for them)")
    s = g.add_mutually_exclusive_group()
    s.add_argument("--json-schema", default=None, metavar="FILE",
                   help="the completion is JSON valid under the schema in FILE (compact: no free whitespace)")
    s.add_argument("--regex", default=None, metavar="RE", help="the completion fully matches RE")
    s.add_argument("--choice", nargs="+", default=None, metavar="STR", help="the completion is one of these strings")
    add_memory_options(g)
    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (pip install -e \".[serve]\")",
                       description="Serve MODEL at /v1/completions, /v1/chat/completions, /v1/models, /health and "
                                   "/metrics; every client's requests are batched together.",
                       formatter_class=_Formatter)
    s.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help="checkpoint directory, built-in name or Hugging Face hub repo id")
    s.add_argument("--served-model-name", default=None, help="the name clients pass as `model` (default: MODEL)")
    s.add_argument("--num-spec", type=_int_at_least(0), default=3, help="draft tokens per step (0 = no speculation)")
    s.add_argument("--draft-model", default=None, help="checkpoint of a separate drafter (default: the model's own)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface; set an API key)")
    s.add_argument("--port", type=_int_at_least(0), default=8000, help="TCP port")
    s.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1/* (default: $MTPKIT_API_KEY; unset: open)")
    s.add_argument("--max-body-bytes", type=byte_count, default=1 << 20, metavar="BYTES",
                   help="largest request body accepted (larger: 413)")
    s.add_argument("--max-num-seqs", type=_int_at_least(1), default=8, help="requests decoded together at most")
    s.add_argument("--max-model-len", type=_int_at_least(2), default=None,
                   help="longest sequence, prompt and completion (None: the model's, at most 4096)")
    s.add_argument("--dtype", default="auto", help="as for generate")
    s.add_argument("--device", default=None, help="cpu, cuda or cuda:N (None: CUDA when a GPU is present)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level")
    add_memory_options(s)
    sub.add_parser("models", help="list the built-in models", formatter_class=_Formatter)
    return p


def _read_prompts(prompts: list[str]) -> list[str]:
    """The prompts, `-` replaced by standard input's text (read once, whatever the count of `-`)."""
    stdin = None
    out = []
    for p in prompts:
        if p == "-":
            if stdin is None:
                stdin = sys.stdin.read().removesuffix("\n")
            p = stdin
        out.append(p)
    return out


def _rates(stats) -> str:
    """Acceptance per draft position; `-` where no draft was ever tried (a short run)."""
    tried = stats.drafted_per_position + [0] * (stats.num_spec - len(stats.drafted_per_position))
    return ", ".join(f"{r:.2f}" if d else "-" for r, d in zip(stats.acceptance_rate_per_position, tried))


def _structured(args):
    """The StructuredOutputs of --json-schema / --regex / --choice, or None (InputError for a bad file)."""
    import json

    from mtpkit.errors import InputError
    from mtpkit.sampling.structured_outputs import StructuredOutputs
    if args.json_schema is not None:
        try:
            with open(args.json_schema, encoding="utf-8") as f:
                text = f.read()
            json.loads(text)
        except (OSError, ValueError) as e:
            raise InputError(f"--json-schema {args.json_schema}: cannot be read as JSON ({e})") from None
        return StructuredOutputs(json=text, disable_any_whitespace=True)
    if args.regex is not None:
        return StructuredOutputs(regex=args.regex)
    if args.choice is not None:
        return StructuredOutputs(choice=args.choice)
    return None


def logprob_table(out) -> str:
    """One line per generated token: its text, logprob and rank, then the likeliest tokens'."""
    lines = []
    for t, entry in zip(out.token_ids, out.logprobs or []):
        own = entry[t]
        name = own.decoded_token if own.decoded_token is not None else f"[{t}]"
        tops = sorted((lp.rank, k, lp) for k, lp in entry.items() if k != t or len(entry) == 1)
        alts = "  ".join(f"{(lp.decoded_token if lp.decoded_token is not None else f'[{k}]')!r} {lp.logprob:.3f}"
                         for _, k, lp in tops if len(entry) > 1)
        lines.append(f"  {name!r:>12} {own.logprob:9.4f} {own.rank:5d}" + (f"   {alts}" if alts else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _main(args)
    except BrokenPipeError:
        # The reader went away (`mtpkit generate ... | head`): nothing more to print, no traceback,
        # and none at interpreter exit either (stdout's buffer would be flushed into the closed pipe).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def _main(args) -> int:
    import mtpkit
    from mtpkit.checkpoint.hub import builtin_models
    from mtpkit.models.registry import describe_builtin

    if args.command == "models":
        print("\n".join(describe_builtin(m) for m in builtin_models()) or "(none)")
        return 0
    if args.command == "serve":
        return _serve(args)
    prompts = _read_prompts(args.prompts)
    single = len(prompts) == 1
    outs: dict[int, object] = {}
    try:
        llm = mtpkit.LLM(args.model, num_spec=args.num_spec, draft_model=args.draft_model, dtype=args.dtype,
                         device=args.device, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                         **memory_kwargs(args))
        gen = llm.generation_defaults.sampling   # the checkpoint's penalties / min_p where no flag gives one
        controls = {k: gen.get(k, off) if getattr(args, k) is None else getattr(args, k)
                    for k, off in (("min_p", 0.0), ("repetition_penalty", 1.0), ("presence_penalty", 0.0),
                                   ("frequency_penalty", 0.0))}
        params = mtpkit.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                       top_p=args.top_p, seed=args.seed, stop=args.stop, logprobs=args.logprobs,
                                       n=args.n, structured_outputs=_structured(args), **controls)
        trace = mtpkit.set_debug(True) if args.debug else None
        t0 = time.perf_counter()
        for ev in llm.stream(prompts[0] if single else prompts, params):
            outs[ev.index] = ev.output
            # final text only: never half a character; several samples are printed at the end
            if single and args.n == 1 and not args.no_stream and ev.delta:
                sys.stdout.write(ev.delta)
                sys.stdout.flush()
        elapsed = time.perf_counter() - t0
    except mtpkit.MtpkitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: what was generated, one line saying so, no traceback
        out = outs.get(0)
        n = sum(len(c.token_ids) for o in outs.values() for c in o.outputs)
        if single and args.n == 1 and args.no_stream and out is not None:
            sys.stdout.write(out.text or " ".join(map(str, out.token_ids)))
        sys.stdout.write("\n")
        sys.stdout.flush()
        print(f"--- interrupted (Ctrl-C) after {n} tokens", file=sys.stderr)
        return 130
    for i in sorted(outs):
        out = outs[i]
        if not single:
            sys.stdout.write(f"{'' if i == 0 else chr(10) * 2}=== [{i}] {prompts[i][:60]!r}\n")
        for c in out.outputs:
            if args.n > 1:
                sys.stdout.write(f"{'' if i == 0 and c.index == 0 and single else chr(10)}--- sample {c.index}\n")
            if not single or args.no_stream or args.n > 1:
                sys.stdout.write(c.text or " ".join(map(str, c.token_ids)))
    n = sum(len(c.token_ids) for o in outs.values() for c in o.outputs)
    reasons = sorted({c.finish_reason for o in outs.values() for c in o.outputs})
    print(f"\n\n--- {n} tokens in {elapsed:.2f} s ({n / elapsed:.1f} tok/s), finish_reason="
          f"{','.join(reasons) if len(reasons) > 1 else reasons[0]}")
    if args.num_spec:
        s = llm.stats if not single or args.n > 1 else outs[0].spec_stats   # every sample's
        print(f"--- num_spec={args.num_spec}: mean acceptance length {s.mean_acceptance_length:.2f} "
              f"over {s.verify_steps} verify steps; accepted {s.num_accepted}/{s.num_drafted} drafts; "
              f"acceptance per position [{_rates(s)}]")
    if args.logprobs is not None:
        for i in sorted(outs):
            for c in outs[i].outputs:
                where = ("" if single else f" of [{i}]") + (f" sample {c.index}" if args.n > 1 else "")
                print(f"\n--- logprobs{where} (token, logprob, rank"
                      f"{f'; then the others of the {args.logprobs} likeliest' if args.logprobs else ''}):")
                print(logprob_table(c))
    if trace is not None:
        print(f"\n--- shape trace ({len(trace)} checked calls; the last 40):")
        print(trace.table(last=40, args=False))
    return 0


def _serve(args) -> int:
    import mtpkit
    try:
        from mtpkit.serve import serve
        import fastapi, uvicorn  # noqa: F401, E401 - the optional extra, checked before the model loads
    except ImportError as e:
        print(f"error: mtpkit serve needs FastAPI and uvicorn ({e}): pip install -e \".[serve]\" "
              "(or pip install fastapi uvicorn)", file=sys.stderr)
        return 2
    try:
        api_key = args.api_key or os.environ.get("MTPKIT_API_KEY") or None
        llm = mtpkit.LLM(args.model, num_spec=args.num_spec, draft_model=args.draft_model, dtype=args.dtype,
                         device=args.device, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                         **memory_kwargs(args))
        if llm.tp.rank == 0:   # under tensor parallelism the other ranks follow rank 0's steps
            print(f"--- serving {args.model} (num_spec={args.num_spec}) at http://{args.host}:{args.port}/v1"
                  + ("" if api_key else " without an API key")
                  + (f", {llm.tp.size} tensor-parallel ranks" if llm.tp.size > 1 else ""), file=sys.stderr)
        serve(llm, model_name=args.served_model_name or args.model, host=args.host, port=args.port,
              api_key=api_key, max_body_bytes=args.max_body_bytes, log_level=args.log_level)
    except mtpkit.MtpkitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
