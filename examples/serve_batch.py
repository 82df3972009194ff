"""Batch generation with MTP speculative decoding: JSONL prompts in, JSONL results out.

    python examples/serve_batch.py --prompts examples/prompts.jsonl --output /tmp/out.jsonl --num-spec 3
    accelerate launch --multi_gpu --num_processes 4 examples/serve_batch.py --model DIR ...   # 4 GPUs
    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \\
        --dynamo_backend no examples/serve_batch.py ...            # 2 CPU processes (gloo)

Input lines are {"prompt": "text"} or {"prompt_token_ids": [1, 2, 3]}, with an optional "n": the
number of samples of that prompt (needs --temperature > 0; the prompt is prefilled once and its
KV shared), and an optional "structured": one of {"json": SCHEMA}, {"json_object": true},
{"regex": "..."}, {"grammar": "..."}, {"choice": ["a", "b"]} (mtpkit.StructuredOutputs' fields,
with "disable_any_whitespace" if wanted): its output then follows that format (and ends at eos
even with --ignore-eos, since a finished structure can only end); blank lines are skipped;
without --prompts a few built-in samples run. Before the model loads, the input is read and
every line checked (JSON, one of the two keys, a non-empty str or a non-empty list of int token
ids within the vocabulary, text only with a tokenizer) and the output's directory checked: a bad
line stops the run with an error naming file:line and the problem (all bad lines at once), or,
with --keep-going, becomes an error record while the other lines run. Output lines keep the
input order: "index", "token_ids", "text", "finish_reason", the request's acceptance stats,
with --logprobs / --prompt-logprobs N "logprobs" / "prompt_logprobs" (per position a list of
{"token_id", "logprob", "rank", "decoded_token"}: its own token first, then the N likeliest),
and "error" for a line that could not run; a line with n > 1 also has "samples", one such record
per sample (the top-level fields are sample 0's; "prompt_logprobs" is the line's, once).
Under `accelerate launch` of N processes, --tensor-parallel-size T (default N) makes N / T
replicas of T consecutive ranks each (a TP group per replica). The prompts are dealt to the
replicas by length (prompt tokens + max_tokens, longest first to the least loaded); a replica
that finishes early takes no work from the others. The first rank of each replica appends each
finished request to its part file (OUTPUT.part-R-of-K, flushed per request, with the input's
line number and a fingerprint of the line and the settings that decide its output), so a killed
job loses only the requests in flight; --resume skips the lines found in the output and the part
files whose fingerprint still matches, and generates again (saying which) the lines whose input
or settings changed since. Rank 0 prints the whole job's progress, gathers every
replica's records and writes OUTPUT complete and in input order.
The memory options are `mtpkit generate`'s (--gpu-memory-utilization, --memory-budget,
--kv-cache-memory, --state-cache-memory, --num-blocks, --num-state-slots, --fp8-weights), for
each rank's device; a budget's plan is printed to stderr.
"""

import argparse
import dataclasses
import glob
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import PartialState

from mtpkit import LLM, InputError, MtpkitError, SamplingParams, StructuredOutputs
from mtpkit.cli import add_memory_options, memory_kwargs
from mtpkit.models.registry import read_config
from mtpkit.checkpoint.hub import resolve_model
from mtpkit.parallel import replica_ranks
from mtpkit.speculative.setup import setup_drafter

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
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help='write "logprobs": for each generated token, its logprob and rank and the N likeliest '
                        "tokens' (SamplingParams.logprobs)")
    p.add_argument("--prompt-logprobs", type=int, default=None, metavar="N",
                   help='write "prompt_logprobs" likewise for every prompt token after the first')
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--cpu", action="store_true", help="run on CPU even where a GPU is present")
    p.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="ranks per model replica; the launched processes form N / T replicas that split the "
                        "prompts (default: every launched process is one replica)")
    p.add_argument("--resume", action="store_true",
                   help="skip input lines already in --output or its part files (a killed run's results)")
    add_memory_options(p)
    # Test hook: the process exits (as if killed) after writing this many records.
    p.add_argument("--exit-after", type=int, default=None, help=argparse.SUPPRESS)
    return p


class BadLine:
    """An input line that cannot run, kept in place (with --keep-going) as an error record."""

    def __init__(self, where: str, problem: str):
        self.error = f"{where}: {problem}"


class StructuredPrompt:
    """A line's prompt with its "structured" format."""

    def __init__(self, prompt, structured: StructuredOutputs):
        self.prompt, self.structured = prompt, structured


def line_prompt(p):
    """The prompt to run (a str or token ids) of a read line."""
    return p.prompt if isinstance(p, StructuredPrompt) else p


def line_params(p, params: SamplingParams) -> SamplingParams:
    """The run's params, with the line's structured outputs (which end at eos) if it has them."""
    if not isinstance(p, StructuredPrompt):
        return params
    return dataclasses.replace(params, structured_outputs=p.structured, ignore_eos=False)


def check_structured(spec) -> tuple:
    """(StructuredOutputs of a line's "structured" value, None), or (None, the problem)."""
    fields = [f.name for f in dataclasses.fields(StructuredOutputs)]
    if not isinstance(spec, dict) or not spec or not set(spec) <= set(fields):
        return None, (f'"structured" must be an object with one of {", ".join(fields[:-1])} (and optionally '
                      f'{fields[-1]}), got {json.dumps(spec)[:60]}')
    so = StructuredOutputs(**spec)
    problems = so.problems()
    return (None, "; ".join(problems)) if problems else (so, None)


def check_line(rec, has_tokenizer: bool, vocab_size: int | None) -> tuple:
    """(the prompt of one parsed line, None), or (None, the problem with it)."""
    if isinstance(rec, dict) and "structured" in rec:
        so, problem = check_structured(rec["structured"])
        if problem is not None:
            return None, problem
        if not has_tokenizer:
            return None, '"structured" needs the checkpoint\'s tokenizer.json, which this one lacks'
        p, problem = check_line({k: v for k, v in rec.items() if k != "structured"}, has_tokenizer, vocab_size)
        return (None, problem) if problem is not None else (StructuredPrompt(p, so), None)
    if not isinstance(rec, dict) or ("prompt" in rec) == ("prompt_token_ids" in rec):
        return None, 'expected an object with one of "prompt" (a str) or "prompt_token_ids" (a list of ints)'
    n = rec.get("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return None, f'"n" must be an int >= 1 (samples of the prompt), got {json.dumps(n)[:40]}'
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


@dataclasses.dataclass(frozen=True)
class Samples:
    """A line's prompt with its "n" > 1 (a line without one is its prompt alone)."""

    prompt: str | list
    n: int


def prompt_and_n(p) -> tuple:
    return (p.prompt, p.n) if isinstance(p, Samples) else (p, 1)


def read_prompts(path: str | None, has_tokenizer: bool, vocab_size: int | None = None) -> tuple[list, list]:
    """Prompts in file order (a str, a token-id list, a Samples, or a BadLine each) and their
    line numbers in the file. Raises InputError when the file cannot be read (missing, a
    directory, unreadable, not UTF-8)."""
    if path is None:
        # Token ids for a checkpoint without a tokenizer (the tiny test checkpoints).
        samples = SAMPLES if has_tokenizer else [[(7 * i + j) % 100 + 1 for j in range(5 + 3 * i)] for i in range(4)]
        return samples, list(range(1, len(samples) + 1))
    f = Path(path)
    if not f.exists():
        raise InputError(f"--prompts {path}: no such file")
    if f.is_dir():
        raise InputError(f"--prompts {path} is a directory; give a JSONL file")
    try:
        text = f.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"--prompts {path} cannot be read: {e}") from e
    prompts, lines = [], []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        lines.append(n)
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            prompts.append(BadLine(f"{path}:{n}", f"not valid JSON ({e.msg} at column {e.colno})"))
            continue
        p, problem = check_line(rec, has_tokenizer, vocab_size)
        if problem is None and rec.get("n", 1) > 1:
            p = Samples(p, rec["n"])
        prompts.append(p if problem is None else BadLine(f"{path}:{n}", problem))
    if not prompts:
        raise InputError(f"--prompts {path} holds no prompts")
    return prompts, lines


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
    return {"index": i, "token_ids": [], "text": "", "finish_reason": "error", "error": bad.error}


# The settings that decide a line's output (num_spec and the drafter do not: speculation never
# changes what is generated); with the line's own text they make its fingerprint.
OUTPUT_SETTINGS = ("model", "max_tokens", "temperature", "seed", "ignore_eos", "dtype", "max_model_len",
                   "logprobs", "prompt_logprobs")


def fingerprints(path: str | None, lines: list, args) -> dict:
    """Input line number -> sha256 of (the line's text, the settings that decide its output)."""
    settings = json.dumps({k: getattr(args, k) for k in OUTPUT_SETTINGS}, sort_keys=True, default=str)
    texts = Path(path).read_text(encoding="utf-8").splitlines() if path is not None else None
    out = {}
    for i, n in enumerate(lines):
        line = texts[n - 1].strip() if texts is not None else json.dumps(SAMPLES[i] if i < len(SAMPLES) else i)
        out[n] = hashlib.sha256((line + "\n" + settings).encode()).hexdigest()[:32]
    return out


def logprob_records(entries: list) -> list:
    """JSON of RequestOutput.logprobs / prompt_logprobs: per position (None for the first prompt
    token) a list of {"token_id", "logprob", "rank", "decoded_token"}, the position's own token
    first, then the likeliest by rank."""
    return [None if d is None else [{"token_id": t, "logprob": lp.logprob, "rank": lp.rank,
                                     "decoded_token": lp.decoded_token} for t, lp in d.items()]
            for d in entries]


def result(i: int, out) -> dict:
    """The line's record: sample 0's fields, and with n > 1 every sample's under "samples"."""
    def fields(c) -> dict:
        s = c.spec_stats
        return {"token_ids": c.token_ids, "text": c.text if c.text is not None else "",
                "finish_reason": c.finish_reason,
                "num_drafted": s.num_drafted, "num_accepted": s.num_accepted, "verify_steps": s.verify_steps,
                "acceptance_rate": s.acceptance_rate, "mean_acceptance_length": s.mean_acceptance_length,
                **({"logprobs": logprob_records(c.logprobs)} if c.logprobs is not None else {}),
                **({"error": c.error} if c.error else {})}
    rec = {"index": i, **fields(out)}
    if out.prompt_logprobs is not None:
        rec["prompt_logprobs"] = logprob_records(out.prompt_logprobs)
    if len(out.outputs) > 1:
        rec["samples"] = [{"index": c.index, **fields(c)} for c in out.outputs]
    return rec


def check_inputs(args) -> list:
    """Everything about the input and output files, before the model loads (InputError)."""
    model = resolve_model(args.model)
    family, cfg = read_config(model)
    # The launch layout and the model's split, from config.json alone: before any weight is read.
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.tensor_parallel_size is not None and args.tensor_parallel_size < 1:
        raise InputError(f"--tensor-parallel-size {args.tensor_parallel_size} must be >= 1")
    replica_ranks(world, args.tensor_parallel_size or world)
    # The drafter's setup says what the target builds for it (the MTP head) and how it splits
    # (the same checks LLM runs; LLM's default block size, which this script keeps).
    draft = setup_drafter(family, cfg, model, num_spec=args.num_spec, draft_model=args.draft_model, block_size=16,
                          load_format="safetensors")
    size = args.tensor_parallel_size or world
    family.model_class.check_tensor_parallel(cfg, size, **(draft.target_kwargs if draft else {}))
    if draft is not None:
        draft.check_tensor_parallel(size)
    # The sampling flags, checked as the engine will check them (negative --logprobs, ...).
    SamplingParams(max_tokens=max(args.max_tokens, 1), temperature=args.temperature, logprobs=args.logprobs,
                   prompt_logprobs=args.prompt_logprobs).validate(cfg.vocab_size)
    prompts, lines = read_prompts(args.prompts, (model / "tokenizer.json").exists(), cfg.vocab_size)
    bad = [p for p in prompts if isinstance(p, BadLine)]
    if bad and not args.keep_going:
        shown = "\n  ".join(b.error for b in bad[:20]) + ("" if len(bad) <= 20 else f"\n  ... {len(bad) - 20} more")
        raise InputError(f"{len(bad)} bad input line(s); nothing was run (--keep-going runs the others and "
                         f"writes these as error records):\n  {shown}")
    check_output(args.output)
    return prompts, lines


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        prompts, lines = check_inputs(args)
    except MtpkitError as e:
        if os.environ.get("RANK", "0") == "0":  # every launched rank finds the same problem
            print(f"error: {e}", file=sys.stderr)
        return 2
    cpu = args.cpu or not torch.cuda.is_available()
    # Joins the launched job (gloo on CPU, NCCL on GPU); a plain `python` run is one process.
    state = PartialState(cpu=cpu)
    try:
        return run(args, prompts, lines, state, cpu)
    except MtpkitError as e:  # the same on every rank: a model or engine limit
        if state.is_main_process:
            print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def shard(costs: dict, replicas: int) -> list[list[int]]:
    """Prompt indices dealt to replicas so their total costs come out even: longest first, each
    to the replica with the least so far (ties: lowest index, lowest replica), the same on every
    rank. A replica that finishes early takes no work from the others."""
    load, shards = [0] * replicas, [[] for _ in range(replicas)]
    for i in sorted(costs, key=lambda i: (-costs[i], i)):
        r = min(range(replicas), key=lambda r: (load[r], r))
        load[r] += costs[i]
        shards[r].append(i)
    return [sorted(s) for s in shards]


def part_files(output: str) -> list[Path]:
    out = Path(output)
    return sorted(out.parent.glob(glob.escape(out.name) + ".part-*"))


def written(output: str, lines: list) -> dict:
    """Records already written for this input, by input line: the output file and the part
    files beside it (a torn last line, where a run was killed mid-write, is skipped)."""
    known, found = set(lines), {}
    for f in [Path(output)] * Path(output).exists() + part_files(output):
        for text in f.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                rec = json.loads(text)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and rec.get("line") in known:
                found[rec["line"]] = rec
    return found


class Progress:
    """The whole job's progress on global rank 0. Every replica's first rank sends its counts
    (done, tokens, drafted, accepted, finished) after each request it writes; rank 0 polls for
    them between its own requests, without waiting, so no replica waits for another."""

    FIELDS = 5

    def __init__(self, group, replicas: list, rank: int, total: int, already: int):
        self.group, self.leads, self.rank = group, [r[0] for r in replicas], rank
        self.total, self.already, self.start, self.shown = total, already, time.perf_counter(), 0.0
        self.counts = {lead: [0] * self.FIELDS for lead in self.leads}
        self.sends, self.recvs = [], {}
        if rank == 0:
            for lead in self.leads[1:]:
                self._post(lead)

    def _post(self, lead: int):
        buf = torch.zeros(self.FIELDS, dtype=torch.float64)
        self.recvs[lead] = (buf, dist.irecv(buf, src=lead, group=self.group))

    def report(self, counts: list, final: bool = False):
        counts = counts + [1 if final else 0]
        if self.rank == 0:
            self.counts[0] = counts
            self.poll()
        elif self.group is not None:
            buf = torch.tensor(counts, dtype=torch.float64)
            self.sends.append((buf, dist.isend(buf, dst=0, group=self.group)))

    def poll(self, wait: bool = False):
        for lead, (buf, work) in list(self.recvs.items()):
            while wait or work.is_completed():
                work.wait()
                self.counts[lead] = [int(v) for v in buf.tolist()]
                del self.recvs[lead]
                self.show()
                if self.counts[lead][-1]:
                    break
                self._post(lead)
                buf, work = self.recvs[lead]
        self.show(force=wait)

    def finish(self):
        """Rank 0 waits for every replica's last report; the others for their sends."""
        if self.rank == 0:
            self.poll(wait=True)
        for _, work in self.sends:
            work.wait()

    def show(self, force: bool = False):
        now = time.perf_counter()
        if not force and now - self.shown < 2.0:
            return
        self.shown = now
        done, tokens, drafted, accepted = (sum(c[k] for c in self.counts.values()) for k in range(4))
        acc = f", acceptance {accepted / drafted:.2f}" if drafted else ""
        print(f"progress: {self.already + done}/{self.total} prompts, "
              f"{tokens / max(now - self.start, 1e-9):.1f} tok/s{acc}", file=sys.stderr, flush=True)


def run(args, prompts: list, lines: list, state, cpu: bool) -> int:
    world, rank = state.num_processes, state.process_index
    size = args.tensor_parallel_size or world
    replicas = replica_ranks(world, size)
    replica, lead = rank // size, rank % size == 0
    # Object exchange and progress go over gloo, which carries CPU tensors under NCCL too.
    group = dist.new_group(backend="gloo") if world > 1 else None
    prints = fingerprints(args.prompts, lines, args)
    if args.resume:
        found = written(args.output, lines)
        if world > 1:  # a machine sees only its own part files: the union of every rank's
            everyone = [None] * world
            dist.all_gather_object(everyone, found, group=group)
            found = {k: v for d in everyone for k, v in d.items()}
        changed = sorted(n for n, rec in found.items() if rec.get("input_sha") != prints[n])
        for n in changed:     # edited since it was written (or written by a version without fingerprints)
            del found[n]
        if changed and rank == 0:
            print(f"resume: input line(s) {changed[:20]}{' ...' if len(changed) > 20 else ''} changed since they "
                  f"were written (their text or the settings {', '.join(OUTPUT_SETTINGS)}): generating them again",
                  file=sys.stderr)
    else:
        found = {}
        if state.is_local_main_process:
            for f in part_files(args.output):
                f.unlink(missing_ok=True)
        state.wait_for_everyone()
    todo = [i for i in range(len(prompts)) if lines[i] not in found]
    if not todo:
        if rank == 0:
            finish_file(args.output, found, lines)
            print(f"nothing to do: all {len(prompts)} prompts are already in {args.output}")
        return 0
    llm = LLM(args.model, num_spec=args.num_spec, draft_model=args.draft_model, max_num_seqs=args.max_num_seqs,
              max_model_len=args.max_model_len, dtype=args.dtype, seed=args.seed,
              device="cpu" if cpu else state.device, tensor_parallel_size=size, **memory_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            ignore_eos=args.ignore_eos, logprobs=args.logprobs, prompt_logprobs=args.prompt_logprobs)

    def per_line(i: int) -> SamplingParams:
        p, n = prompt_and_n(prompts[i])
        return line_params(p, params if n == 1 else dataclasses.replace(params, n=n))
    # Bad lines cost nothing to run: replica 0 writes them. The rest are dealt by length.
    bad = [i for i in todo if isinstance(prompts[i], BadLine)]
    costs, refused = {}, []
    for i in todo:
        if isinstance(prompts[i], BadLine):
            continue
        # Limits only the engine knows (prompt + max_tokens beyond max_model_len), checked for
        # every prompt on every rank: a replica that alone refused its share would leave the
        # others waiting for it. With --keep-going they come back as error outputs.
        try:
            ids, sp = llm._validate(line_prompt(prompt_and_n(prompts[i])[0]), per_line(i),
                                    f"{args.prompts or 'sample'}:{lines[i]}")
            costs[i] = len(ids) + sp.n * args.max_tokens
        except InputError as e:
            costs[i] = 0
            refused.append(str(e))
    if refused and not args.keep_going:
        raise InputError(f"{len(refused)} prompt(s) the engine cannot run; nothing was run (--keep-going runs "
                         "the others and writes these as error records):\n  " + "\n  ".join(refused[:20]))
    mine = shard(costs, len(replicas))[replica]
    progress = Progress(group, replicas, rank, len(prompts), len(found))
    part = open(f"{args.output}.part-{replica}-of-{len(replicas)}", "a+", encoding="utf-8") if lead else None
    if part is not None and part.tell():  # a killed run may have left half a line: start a new one
        part.seek(part.tell() - 1)
        if part.read(1) != "\n":
            part.write("\n")
    records, counts = [], [0, 0, 0, 0]

    def write(i: int, rec: dict):
        rec["line"], rec["input_sha"] = lines[i], prints[lines[i]]
        records.append(rec)
        if part is not None:  # flushed per request: a killed job loses only those in flight
            part.write(json.dumps(rec) + "\n")
            part.flush()
            if args.exit_after is not None and len(records) >= args.exit_after:
                os._exit(3)

    start = time.perf_counter()
    for i in bad if replica == 0 else []:
        write(i, error_record(i, prompts[i]))
    events = llm.stream([line_prompt(prompt_and_n(prompts[i])[0]) for i in mine], [per_line(i) for i in mine],
                        errors="return" if args.keep_going else "raise") if mine else []
    done = set()
    for ev in events:
        # a line is written once all its samples have finished (two finishing in one step
        # both see the whole output: the first writes it)
        if not ev.output.finished or ev.index in done:
            continue
        done.add(ev.index)
        out = ev.output
        write(mine[ev.index], result(mine[ev.index], out))
        if out.error is None:
            counts = [counts[0] + 1, counts[1] + sum(len(c.token_ids) for c in out.outputs),
                      counts[2] + sum(c.spec_stats.num_drafted for c in out.outputs),
                      counts[3] + sum(c.spec_stats.num_accepted for c in out.outputs)]
        if lead:
            progress.report(counts)
    if lead:
        progress.report(counts, final=True)
        part.close()
        progress.finish()
    elapsed = max(time.perf_counter() - start, 1e-9)
    # Rank 0 puts the file together: every replica's records (their part files may be on
    # other machines) and those found at the start, in input order.
    gathered = [None] * world if rank == 0 else None
    if world > 1:
        dist.gather_object((records if lead else [], counts if lead else None), gathered, dst=0, group=group)
    else:
        gathered = [(records, counts)]
    if rank == 0:
        for recs, _ in gathered:
            found.update({r["line"]: r for r in recs})
        finish_file(args.output, found, lines)
        per_replica = [gathered[r[0]][1] for r in replicas]
        tokens = sum(c[1] for c in per_replica)
        done = sum(c[0] for c in per_replica)
        print(f"{done}/{len(prompts)} requests generated ({len(prompts) - len(todo)} already written), {tokens} "
              f"tokens in {elapsed:.2f} s: {tokens / elapsed:.1f} tok/s, {done / elapsed:.2f} req/s "
              f"(replicas {len(replicas)} x tensor parallel {size}, num_spec {args.num_spec}); per replica: "
              + ", ".join(f"{r}: {c[0]} requests {c[1]} tokens" for r, c in enumerate(per_replica)))
        if args.num_spec:
            drafted, accepted = sum(c[2] for c in per_replica), sum(c[3] for c in per_replica)
            print(f"acceptance: {accepted}/{drafted} drafts accepted"
                  + (f" ({accepted / drafted:.3f})" if drafted else "") + f"; this replica: {llm.stats}")
        print(f"wrote {args.output}")
    state.wait_for_everyone()
    if lead:  # the records are in the output now
        Path(f"{args.output}.part-{replica}-of-{len(replicas)}").unlink(missing_ok=True)
    return 0


def finish_file(output: str, found: dict, lines: list) -> None:
    """The output in input order, written whole and then renamed over the old one, so it is
    never half written; the part files it holds are removed."""
    missing = [n for n in lines if n not in found]
    if missing:
        raise RuntimeError(f"records for input lines {missing[:10]} are missing")
    text = "".join(json.dumps(found[n]) + "\n" for n in lines)
    if not Path(output).exists() or Path(output).read_text(encoding="utf-8") != text:
        tmp = Path(f"{output}.tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, output)
    for f in part_files(output):
        f.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
