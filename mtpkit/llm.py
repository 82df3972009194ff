"""The facade: load a checkpoint, generate (batch or streaming), score, stats.

Everything that can be wrong with a configuration or an input is checked before any model
work: configuration at construction (before weights are read), prompts and sampling values
when they are added.
"""

import dataclasses
import itertools
import json
import operator
from pathlib import Path
from typing import Iterator, Sequence

import torch

from .config import EngineConfig, Qwen3NextConfig, resolve_dtype
from .engine.cache import (BlockAllocator, SlotAllocator, allocate_cache, kv_bytes_per_block,
                           state_bytes_per_slot)
from .engine.request import Request, RequestOutput, SpecStats, Status
from .engine.runner import ModelRunner
from .engine.scheduler import Scheduler
from .errors import ConfigError, InputError
from .graphs.plan import build_capture_plan
from .models.registry import resolve_model
from .sampling import SamplingParams

Prompt = str | Sequence[int]


@dataclasses.dataclass
class StreamEvent:
    """One request's increment after a step."""

    index: int                      # position of the prompt in the call
    new_token_ids: list[int]
    text: str                       # the whole text so far
    finished: bool
    output: RequestOutput


class LLM:
    def __init__(self, model: str | Path, *, num_spec: int = 0, max_num_seqs: int = 8,
                 max_model_len: int | None = None, dtype="auto", device=None,
                 enforce_eager: bool = False, seed: int = 0, block_size: int = 16,
                 num_blocks: int | None = None, num_state_slots: int | None = None,
                 kv_cache_memory: int | None = None, state_cache_memory: int | None = None,
                 max_num_batched_tokens: int = 2048,
                 graph_sizes: Sequence[int] | None = None,
                 cudagraph_capture_sizes: Sequence[int] | None = None,
                 attn_backend: str | None = None, tensor_parallel_size: int | None = None,
                 load_format: str = "safetensors", num_threads: int | None = None):
        """tensor_parallel_size: ranks the model is split over; None means every process of
        the launched job (`accelerate launch` / torchrun), 1 when not launched. It must equal
        the launched world size. Every rank runs the engine and returns the same outputs.
        load_format "dummy": random weights from config.json alone (benchmarks, GPU checks).
        num_threads (CPU): torch's intra-op threads. None: 1 for models under 50M parameters,
        whose ops are too small to gain from threads and which slow down 10-40x when another
        process holds a core (threads wait on each other at every op); larger models keep
        torch's default. It is process-wide (torch.set_num_threads)."""
        if load_format not in ("safetensors", "dummy"):
            raise ConfigError(f"load_format={load_format!r} must be 'safetensors' or 'dummy'")
        path = resolve_model(model)
        self.model_path = path
        self.model_config = cfg = Qwen3NextConfig.from_file(path)
        self.device = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = resolve_dtype(dtype, self.device, cfg.torch_dtype)
        for name, v in (("max_num_seqs", max_num_seqs), ("block_size", block_size),
                        ("max_num_batched_tokens", max_num_batched_tokens), ("seed", seed),
                        ("max_model_len", max_model_len), ("num_blocks", num_blocks),
                        ("num_state_slots", num_state_slots), ("kv_cache_memory", kv_cache_memory),
                        ("state_cache_memory", state_cache_memory), ("num_threads", num_threads)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                raise ConfigError(f"{name}={v!r} must be an int")
        if num_threads is not None and num_threads < 1:
            raise ConfigError(f"num_threads={num_threads} must be >= 1")
        if not isinstance(num_spec, int) or isinstance(num_spec, bool) or not 0 <= num_spec <= 8:
            raise ConfigError(f"num_spec={num_spec!r} must be an int in 0..8")
        # Tensor parallelism: what config.json cannot split is refused first, then a size that
        # differs from the launched job.
        from .models.qwen3_next import check_tensor_parallel
        from .parallel import TP
        if isinstance(tensor_parallel_size, int):
            check_tensor_parallel(cfg, tensor_parallel_size, with_mtp=num_spec > 0)
        self.tp = tp = TP.launched(tensor_parallel_size, self.device)
        check_tensor_parallel(cfg, tp.size, with_mtp=num_spec > 0)
        self.device = tp.rank_device(self.device)
        if max_model_len is None:
            max_model_len = min(cfg.max_position_embeddings, 4096)
        if max_model_len < 2 or max_model_len > cfg.max_position_embeddings:
            raise ConfigError(f"max_model_len={max_model_len} must be in 2..max_position_embeddings="
                              f"{cfg.max_position_embeddings}")
        if block_size < 1 or max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ConfigError("block_size, max_num_seqs and max_num_batched_tokens must be >= 1")
        bundle = num_spec + 1
        # Pool sizes: explicit counts, else a memory budget, else enough for the workload.
        max_blocks = -(-(max_model_len + 2 * num_spec) // block_size)
        if num_blocks is None:
            if kv_cache_memory is not None:
                per_block = kv_bytes_per_block(cfg, len(cfg.full_layers) + (1 if num_spec else 0),
                                               block_size, self.dtype, tp.size)
                num_blocks = max(kv_cache_memory // per_block, 0)
            else:
                num_blocks = 1 + max_num_seqs * max_blocks
        if num_blocks < 1 + max_blocks:
            raise ConfigError(f"num_blocks={num_blocks} cannot hold one sequence of max_model_len="
                              f"{max_model_len} (needs {max_blocks} blocks of {block_size} plus the null "
                              "block); give more KV memory or lower max_model_len")
        if num_state_slots is None and state_cache_memory is not None:
            state_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
            num_state_slots = state_cache_memory // state_bytes_per_slot(cfg, num_spec, self.dtype,
                                                                         state_dtype, tp.size)
        num_state_slots = num_state_slots or 1 + max_num_seqs * bundle
        self.engine_config = ecfg = EngineConfig(
            num_spec=num_spec, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            block_size=block_size, num_blocks=num_blocks, num_state_slots=num_state_slots,
            max_num_batched_tokens=max_num_batched_tokens, enforce_eager=enforce_eager)
        # Graph plan (and its configuration errors) before any weight is read.
        self.capture_plan = build_capture_plan(
            num_spec=num_spec, max_num_seqs=max_num_seqs,
            max_state_reqs=(num_state_slots - 1) // bundle,
            graph_sizes=graph_sizes, cudagraph_capture_sizes=cudagraph_capture_sizes)
        from .models.loader import checkpoint_index, has_mtp_weights, load_checkpoint
        from .models.qwen3_next import Qwen3NextForCausalLM
        from .models.dummy import init_dummy_weights
        from .attn.backend import select_backend

        # Reading weights can fail on one rank only (a bad file, memory): every rank finishes
        # this block, then all learn of any failure and raise, instead of the others hanging.
        error = None
        try:
            if load_format == "safetensors":
                checkpoint_index(path)  # a missing or broken weights file is reported before any work
                if num_spec > 0 and not has_mtp_weights(path):
                    raise ConfigError(f"num_spec={num_spec} needs the checkpoint's mtp.* weights, and {path} "
                                      "has none; use num_spec=0 or a checkpoint with an MTP head")
            ops = select_backend(self.device, attn_backend)
            self.model = Qwen3NextForCausalLM(cfg, ops, tp, with_mtp=num_spec > 0)
            if load_format == "dummy":
                init_dummy_weights(self.model, self.dtype, self.device, seed)
            else:
                load_checkpoint(self.model, path, self.dtype, self.device)
            self.model.set_weight_layout(self.device)
            self.cache = allocate_cache(cfg, num_blocks=num_blocks, num_slots=num_state_slots,
                                        block_size=block_size, num_spec=num_spec,
                                        n_kv_layers=self.model.num_kv_layers, dtype=self.dtype,
                                        device=self.device, tp_size=tp.size)
        except Exception as e:
            error = e
        tp.raise_if_any_failed(error, "loading the model")
        self.blocks = BlockAllocator(num_blocks)
        self.slots = SlotAllocator(num_state_slots, bundle)
        dispatch = None if enforce_eager else self.capture_plan.dispatch
        self.scheduler = Scheduler(ecfg, self.blocks, self.slots, dispatch)
        self.runner = ModelRunner(self.model, self.cache, ecfg, self.device,
                                  None if enforce_eager else self.capture_plan)
        self.tokenizer = _load_tokenizer(path)
        self.eos_token_ids = _eos_ids(path, cfg)
        if self.device.type == "cpu":
            params = sum(p.numel() for p in self.model.parameters())
            threads = num_threads if num_threads is not None else (1 if params < 50_000_000 else None)
            if threads is not None and threads != torch.get_num_threads():
                torch.set_num_threads(threads)
        self.seed = seed
        self._ids = itertools.count()
        self.stats = SpecStats(num_spec=num_spec)

    # ---- inputs ---------------------------------------------------------------------
    def _tokens(self, prompt: Prompt, where: str) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InputError(f"{where}: this checkpoint has no tokenizer.json; pass token ids")
            ids = self.tokenizer.encode(prompt).ids
        else:
            ids, bad = [], []
            for t in prompt:  # Python, numpy and torch integers; not bools or floats
                try:
                    if isinstance(t, bool) or getattr(t, "dtype", None) == torch.bool:
                        raise TypeError
                    t = operator.index(t)
                except TypeError:
                    bad.append(t)
                    continue
                ids.append(t)
                if not 0 <= t < self.model_config.vocab_size:
                    bad.append(t)
            if bad:
                raise InputError(f"{where}: token ids {bad[:8]} are outside the vocabulary "
                                 f"0..{self.model_config.vocab_size - 1}")
        if not ids:
            raise InputError(f"{where}: the prompt is empty; give at least one token")
        return ids

    def _validate(self, prompt: Prompt, params: SamplingParams | None, where: str) -> list[int]:
        params = params or SamplingParams()
        try:
            params.validate(self.model_config.vocab_size)
        except InputError as e:
            raise InputError(f"{where}: {e}") from None
        ids = self._tokens(prompt, where)
        total, limit = len(ids) + params.max_tokens, self.engine_config.max_model_len
        if total > limit:
            raise InputError(f"{where}: {len(ids)} prompt tokens + max_tokens={params.max_tokens} = {total} "
                             f"exceeds max_model_len={limit}; shorten the prompt, lower max_tokens or "
                             "raise max_model_len")
        return ids

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, *,
                    where: str = "prompt") -> Request:
        """Validate and queue one request (raises InputError; queued requests are unaffected)."""
        return self._enqueue(self._validate(prompt, params, where), params or SamplingParams())

    def _enqueue(self, ids: list[int], params: SamplingParams) -> Request:
        """Queue an already validated request."""
        ecfg = self.engine_config
        rid = next(self._ids)
        # A random request's tokens are drawn from noise keyed by (seed, token position)
        # (mtpkit.sampling): without a seed of its own it gets a fixed one from LLM.seed and
        # its id, so it too is reproducible under preemption.
        seed = None
        if params.temperature > 0:
            seed = params.seed if params.seed is not None else hash((self.seed, rid)) & (2**63 - 1)
        req = Request(rid, ids, params, () if params.ignore_eos else self.eos_token_ids, seed)
        req.stats.num_spec = ecfg.num_spec
        self.scheduler.add(req)
        return req

    # ---- running --------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one engine step; returns the requests it advanced."""
        plan = self.scheduler.schedule()
        if plan is None:
            return []
        results = self.runner.execute(plan)
        for r in self.scheduler.update(plan, results):
            self.stats.merge(r.stats)
        return plan.reqs

    def _prepare(self, prompts, sampling_params, errors: str):
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise InputError(f"{len(sampling_params)} SamplingParams for {len(prompts)} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params or SamplingParams()] * len(prompts)
        if errors not in ("raise", "return"):
            raise InputError(f"errors={errors!r} must be 'raise' or 'return'")
        # Validate every prompt before queueing any, so a bad one costs no model work.
        problems, valid = {}, {}
        for i, (p, sp) in enumerate(zip(prompts, params)):
            try:
                valid[i] = self._validate(p, sp, f"prompt {i}")
            except InputError as e:
                problems[i] = str(e)
        if problems and errors == "raise":
            raise InputError("; ".join(problems.values()) + (
                "" if len(prompts) == 1 else " (nothing was run; pass errors='return' to run the valid "
                "prompts and get the errors back as outputs)"))
        reqs = {i: self._enqueue(ids, params[i] or SamplingParams()) for i, ids in valid.items()}
        return prompts, reqs, problems

    def stream(self, prompts, sampling_params=None, *, errors: str = "raise") -> Iterator[StreamEvent]:
        """Yield each request's new tokens after every step, until all have finished."""
        prompts, reqs, problems = self._prepare(prompts, sampling_params, errors)
        for i, msg in problems.items():
            yield StreamEvent(i, [], "", True, self._error_output(prompts[i], msg))
        index = {r.req_id: i for i, r in reqs.items()}
        seen = {r.req_id: 0 for r in reqs.values()}
        live = set(seen)
        while live:
            for r in self.step():
                if r.req_id not in live:
                    continue
                new = r.output_token_ids[seen[r.req_id]:]
                if new or r.status == Status.FINISHED:
                    seen[r.req_id] = len(r.output_token_ids)
                    out = self._output(r)
                    yield StreamEvent(index[r.req_id], new, out.text or "", out.finished, out)
                if r.status == Status.FINISHED:
                    live.discard(r.req_id)

    def generate(self, prompts, sampling_params=None, *, errors: str = "raise",
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. prompts: a str, a list of str, or a list of
        token-id lists. errors='raise' refuses the whole call if any prompt is bad (before any
        model work); errors='return' runs the others and returns the bad ones with .error set."""
        outputs: dict[int, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(desc="generating", unit="tok")
        for ev in self.stream(prompts, sampling_params, errors=errors):
            if bar is not None:
                bar.update(len(ev.new_token_ids))
            if ev.finished:
                outputs[ev.index] = ev.output
        if bar is not None:
            bar.close()
        return [outputs[i] for i in sorted(outputs)]

    def _output(self, r: Request) -> RequestOutput:
        text = self.tokenizer.decode(r.output_token_ids) if self.tokenizer is not None else None
        return RequestOutput(r.req_id, list(r.prompt_token_ids), list(r.output_token_ids), text,
                             r.finish_reason, r.stats, None, r.num_preemptions)

    def _error_output(self, prompt, msg: str) -> RequestOutput:
        ids = list(prompt) if not isinstance(prompt, str) else []
        return RequestOutput(-1, ids, [], None, "error", SpecStats(), msg)

    # ---- scoring --------------------------------------------------------------------
    @torch.inference_mode()
    def score(self, token_ids: Sequence[int]) -> torch.Tensor:
        """fp32 logits [seq, vocab] of every position of one sequence, through the engine's
        (chunked) prefill path."""
        ids = self._tokens(token_ids, "score")
        ecfg = self.engine_config
        if len(ids) > ecfg.max_model_len:
            raise InputError(f"score: {len(ids)} tokens exceed max_model_len={ecfg.max_model_len}")
        slots = self.slots.allocate()
        blocks = self.blocks.allocate(-(-len(ids) // ecfg.block_size))
        if slots is None or blocks is None:
            if slots is not None:
                self.slots.free(slots)
            raise InputError("score: the caches are full with running requests; call it when they finish")
        from .attn.metadata import PrefillChunk
        try:
            out, start = [], 0
            while start < len(ids):
                n = min(ecfg.max_num_batched_tokens, len(ids) - start)
                chunk = PrefillChunk(ids[start:start + n], start, blocks, slots[0], slots[-1])
                hidden, _, _ = self.runner.prefill_hidden([chunk])
                out.append(self.model.compute_logits(hidden).float())
                start += n
            return torch.cat(out)
        finally:
            self.blocks.free(blocks)
            self.slots.free(slots)


def _load_tokenizer(path: Path):
    f = path / "tokenizer.json"
    if not f.exists():
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(f))


def _eos_ids(path: Path, cfg: Qwen3NextConfig) -> tuple[int, ...]:
    ids = set(cfg.eos_token_ids)
    gen = path / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            ids.update(eos if isinstance(eos, list) else [eos])
    return tuple(sorted(ids))
