"""Batch generation with MTP speculative decoding: JSONL prompts in, JSONL results out.

    python examples/serve_batch.py --prompts in.jsonl --output out.jsonl --num-spec 3 --max-tokens 64
    accelerate launch --multi_gpu --num_processes 4 examples/serve_batch.py --model DIR ...   # 4 GPUs
    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \\
        --dynamo_backend no examples/serve_batch.py ...            # 2 CPU processes (gloo)

Input lines are {"prompt": "text"} or {"prompt_token_ids": [1, 2, 3]}; without --prompts a few
built-in samples run. Output lines keep the input order: "index", "token_ids", "text",
"finish_reason", the request's acceptance stats, and "error" for a line that could not run.
Under `accelerate launch` every process is one tensor-parallel rank: the model is split over all
of them, each runs the same engine, and rank 0 writes the file and prints.
"""

import argparse
import json
import sys
import time

import torch
from accelerate import PartialState

from mtpkit import LLM, InputError, SamplingParams

SAMPLES = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "Speculative decoding works by"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-qwen3-next", help="checkpoint directory or built-in name")
    p.add_argument("--prompts", help="input JSONL (default: built-in samples)")
    p.add_argument("--output", default="out.jsonl", help="output JSONL")
    p.add_argument("--num-spec", type=int, default=3, help="MTP draft tokens per step (0: no MTP)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="engine seed (per-request sampling streams)")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--cpu", action="store_true", help="run on CPU even where a GPU is present")
    return p


def read_prompts(path: str | None, has_tokenizer: bool) -> list:
    """Prompts in file order: a str or a token-id list each."""
    if path is None:
        # Token ids for a checkpoint without a tokenizer (the tiny test checkpoints).
        return SAMPLES if has_tokenizer else [[(7 * i + j) % 100 + 1 for j in range(5 + 3 * i)] for i in range(4)]
    prompts = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            if not isinstance(rec, dict) or ("prompt" in rec) == ("prompt_token_ids" in rec):
                raise InputError(f"{path}:{n}: expected {{\"prompt\": str}} or {{\"prompt_token_ids\": [int]}}")
            prompts.append(rec.get("prompt", rec.get("prompt_token_ids")))
    return prompts


def result(i: int, out) -> dict:
    s = out.spec_stats
    return {"index": i, "token_ids": out.token_ids, "text": out.text, "finish_reason": out.finish_reason,
            "num_drafted": s.num_drafted, "num_accepted": s.num_accepted, "verify_steps": s.verify_steps,
            "acceptance_rate": s.acceptance_rate, "mean_acceptance_length": s.mean_acceptance_length,
            **({"error": out.error} if out.error else {})}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    cpu = args.cpu or not torch.cuda.is_available()
    # Joins the launched job (gloo on CPU, NCCL on GPU); a plain `python` run is one process.
    state = PartialState(cpu=cpu)
    llm = LLM(args.model, num_spec=args.num_spec, max_num_seqs=args.max_num_seqs,
              max_model_len=args.max_model_len, dtype=args.dtype, seed=args.seed,
              device="cpu" if cpu else state.device, tensor_parallel_size=state.num_processes)
    prompts = read_prompts(args.prompts, llm.tokenizer is not None)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            ignore_eos=args.ignore_eos)
    main_rank = state.is_main_process
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, errors="return", use_tqdm=main_rank)
    elapsed = time.perf_counter() - start
    if main_rank:
        with open(args.output, "w") as f:
            for i, out in enumerate(outputs):
                f.write(json.dumps(result(i, out)) + "\n")
        done = [o for o in outputs if o.error is None]
        tokens = sum(len(o.token_ids) for o in done)
        print(f"{len(done)}/{len(outputs)} requests, {tokens} tokens in {elapsed:.2f} s: "
              f"{tokens / elapsed:.1f} tok/s, {len(done) / elapsed:.2f} req/s "
              f"(tensor parallel {llm.tp.size}, num_spec {args.num_spec})")
        if args.num_spec:
            print(f"acceptance: {llm.stats}")
        print(f"wrote {args.output}")
    state.wait_for_everyone()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
