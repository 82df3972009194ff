"""Batch generation with MTP speculative decoding: JSONL prompts in, JSONL results out.

    python examples/serve_batch.py --prompts examples/prompts.jsonl --output /tmp/out.jsonl --num-spec 3
    accelerate launch --multi_gpu --num_processes 4 examples/serve_batch.py --model DIR ...   # 4 GPUs
    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \\
        --dynamo_backend no examples/serve_batch.py ...            # 2 CPU processes (gloo)

Input lines are {"prompt": "text"} or {"prompt_token_ids": [1, 2, 3]}; blank lines are skipped;
without --prompts a few built-in samples run. Before the model loads, the input is read and
every line checked (JSON, one of the two keys, a non-empty str or a non-empty list of int token
ids within the vocabulary, text only with a tokenizer) and the output's directory checked: a bad
line stops the run with an error naming file:line and the problem (all bad lines at once), or,
with --keep-going, becomes an error record while the other lines run. Output lines keep the
input order: "index", "token_ids", "text", "finish_reason", the request's acceptance stats, and
"error" for a line that could not run.
Under `accelerate launch` every process is one tensor-parallel rank: the model is split over all
of them, each runs the same engine, and rank 0 writes the file and prints.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from accelerate import PartialState

from mtpkit import LLM, InputError, MtpkitError, SamplingParams
from mtpkit.models.registry import read_config, resolve_model

SAMPLES = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "Speculative decoding works by"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-qwen3-next", help="checkpoint directory or built-in name")
    p.add_argument("--prompts", help="input JSONL (default: built-in samples)")
    p.add_argument("--output", default="out.jsonl", help="output JSONL (default: out.jsonl in the current directory)")
    p.add_argument("--keep-going", action="store_true",
                   help="write a bad input line as an error record and run the others (default: refuse the "
                        "whole batch before loading the model)")
    p.add_argument("--num-spec", type=int, default=3, help="draft tokens per step (0: no speculation)")
    p.add_argument("--draft-model", default=None,
                   help="checkpoint directory or built-in name of a separate drafter (default: the model's own, "
                        "e.g. Qwen3-Next's MTP head)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="engine seed (per-request sampling streams)")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--cpu", action="store_true", help="run on CPU even where a GPU is present")
    return p


class BadLine:
    """An input line that cannot run, kept in place (with --keep-going) as an error record."""

    def __init__(self, where: str, problem: str):
        self.error = f"{where}: {problem}"


def check_line(rec, has_tokenizer: bool, vocab_size: int | None) -> tuple:
    """(the prompt of one parsed line, None), or (None, the problem with it)."""
    if not isinstance(rec, dict) or ("prompt" in rec) == ("prompt_token_ids" in rec):
        return None, 'expected an object with one of "prompt" (a str) or "prompt_token_ids" (a list of ints)'
    if "prompt" in rec:
        p = rec["prompt"]
        if not isinstance(p, str):
            return None, f'"prompt" must be a str, got {type(p).__name__} {p!r:.40}'
        if not p:
            return None, '"prompt" is empty'
        if not has_tokenizer:
            return None, 'this checkpoint has no tokenizer.json: give "prompt_token_ids" instead of "prompt"'
        return p, None
    ids = rec["prompt_token_ids"]
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return None, f'"prompt_token_ids" must be a list of ints, got {json.dumps(ids)[:60]}'
    if not ids:
        return None, '"prompt_token_ids" is empty'
    if vocab_size is not None:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            return None, f'"prompt_token_ids" {bad[:8]} are outside the vocabulary 0..{vocab_size - 1}'
    return ids, None


def read_prompts(path: str | None, has_tokenizer: bool, vocab_size: int | None = None) -> list:
    """Prompts in file order: a str, a token-id list, or a BadLine each. Raises InputError when
    the file cannot be read (missing, a directory, unreadable, not UTF-8)."""
    if path is None:
        # Token ids for a checkpoint without a tokenizer (the tiny test checkpoints).
        return SAMPLES if has_tokenizer else [[(7 * i + j) % 100 + 1 for j in range(5 + 3 * i)] for i in range(4)]
    f = Path(path)
    if not f.exists():
        raise InputError(f"--prompts {path}: no such file")
    if f.is_dir():
        raise InputError(f"--prompts {path} is a directory; give a JSONL file")
    try:
        text = f.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"--prompts {path} cannot be read: {e}") from e
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            prompts.append(BadLine(f"{path}:{n}", f"not valid JSON ({e.msg} at column {e.colno})"))
            continue
        p, problem = check_line(rec, has_tokenizer, vocab_size)
        prompts.append(p if problem is None else BadLine(f"{path}:{n}", problem))
    if not prompts:
        raise InputError(f"--prompts {path} holds no prompts")
    return prompts


def check_output(path: str) -> None:
    """The output file can be written: its directory exists and is writable, it is not a directory."""
    out = Path(path)
    parent = out.parent if str(out.parent) else Path(".")
    if out.is_dir():
        raise InputError(f"--output {path} is a directory; give a file path")
    if not parent.is_dir():
        raise InputError(f"--output {path}: the directory {parent} does not exist; create it or choose another path")
    if not os.access(parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise InputError(f"--output {path} is not writable")


def error_record(i: int, bad: BadLine) -> dict:
    return {"index": i, "token_ids": [], "text": None, "finish_reason": "error", "error": bad.error}


def result(i: int, out) -> dict:
    s = out.spec_stats
    return {"index": i, "token_ids": out.token_ids, "text": out.text, "finish_reason": out.finish_reason,
            "num_drafted": s.num_drafted, "num_accepted": s.num_accepted, "verify_steps": s.verify_steps,
            "acceptance_rate": s.acceptance_rate, "mean_acceptance_length": s.mean_acceptance_length,
            **({"error": out.error} if out.error else {})}


def check_inputs(args) -> list:
    """Everything about the input and output files, before the model loads (InputError)."""
    model = resolve_model(args.model)
    vocab_size = read_config(model)[1].vocab_size
    prompts = read_prompts(args.prompts, (model / "tokenizer.json").exists(), vocab_size)
    bad = [p for p in prompts if isinstance(p, BadLine)]
    if bad and not args.keep_going:
        shown = "\n  ".join(b.error for b in bad[:20]) + ("" if len(bad) <= 20 else f"\n  ... {len(bad) - 20} more")
        raise InputError(f"{len(bad)} bad input line(s); nothing was run (--keep-going runs the others and "
                         f"writes these as error records):\n  {shown}")
    check_output(args.output)
    return prompts


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        prompts = check_inputs(args)
    except MtpkitError as e:
        if os.environ.get("RANK", "0") == "0":  # every launched rank finds the same problem
            print(f"error: {e}", file=sys.stderr)
        return 2
    cpu = args.cpu or not torch.cuda.is_available()
    # Joins the launched job (gloo on CPU, NCCL on GPU); a plain `python` run is one process.
    state = PartialState(cpu=cpu)
    try:
        return run(args, prompts, state, cpu)
    except MtpkitError as e:  # the same on every rank: a model or engine limit
        if state.is_main_process:
            print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run(args, prompts: list, state, cpu: bool) -> int:
    llm = LLM(args.model, num_spec=args.num_spec, draft_model=args.draft_model, max_num_seqs=args.max_num_seqs,
              max_model_len=args.max_model_len, dtype=args.dtype, seed=args.seed,
              device="cpu" if cpu else state.device, tensor_parallel_size=state.num_processes)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            ignore_eos=args.ignore_eos)
    main_rank = state.is_main_process
    good = [i for i, p in enumerate(prompts) if not isinstance(p, BadLine)]
    start = time.perf_counter()
    # Limits only the engine knows (prompt + max_tokens beyond max_model_len) come back as error
    # outputs with --keep-going, and refuse the batch (before any generation) without it.
    outputs = llm.generate([prompts[i] for i in good], params, errors="return" if args.keep_going else "raise",
                           use_tqdm=main_rank) if good else []
    elapsed = max(time.perf_counter() - start, 1e-9)
    if main_rank:
        by_index = dict(zip(good, outputs))
        with open(args.output, "w") as f:
            for i, p in enumerate(prompts):
                rec = error_record(i, p) if isinstance(p, BadLine) else result(i, by_index[i])
                f.write(json.dumps(rec) + "\n")
        done = [o for o in outputs if o.error is None]
        tokens = sum(len(o.token_ids) for o in done)
        print(f"{len(done)}/{len(prompts)} requests, {tokens} tokens in {elapsed:.2f} s: "
              f"{tokens / elapsed:.1f} tok/s, {len(done) / elapsed:.2f} req/s "
              f"(tensor parallel {llm.tp.size}, num_spec {args.num_spec})")
        if args.num_spec:
            print(f"acceptance: {llm.stats}")
        print(f"wrote {args.output}")
    state.wait_for_everyone()
    return 0


if __name__ == "__main__":
    sys.exit(main())
