"""The facade: load a checkpoint, generate (batch or streaming), score, stats.

Everything that can be wrong with a configuration or an input is checked before any model
work: configuration at construction (before weights are read), prompts and sampling values
when they are added.
"""

import contextlib
import functools
import dataclasses
import inspect
import numbers
import operator
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import torch

from mtpkit.engine.args import EngineArgs
from mtpkit.engine.build import build_engine, open_checkpoint
from mtpkit.engine.inputs import (id_sequence, is_bool, normalize_sampling_params, prompt_list, short_repr,
                                  utf8_text)
from mtpkit.engine import interrupts
from mtpkit.engine.follow import follow as follow_ops
from mtpkit.engine.loop import run_call, stream_call
from mtpkit.engine.request import CompletionOutput, Request, RequestOutput, SpecStats, Status
from mtpkit.errors import InputError
from mtpkit.sampling.params import SamplingParams
from mtpkit.text.chat import load_chat_template, special_tokens
from mtpkit.text.detokenize import IncrementalDetokenizer
from mtpkit.text.generation_config import read_generation_defaults
from mtpkit.text.stop_strings import StopStringMatcher, cut_at_stop
from mtpkit.text.tokenizer import load_tokenizer

Prompt = str | Sequence[int]
MAX_LISTED = 20   # bad prompts listed in one error (then a count)


class StreamEvent:
    """One sample's increment after a step (a prompt has SamplingParams.n samples, 1 by
    default: new_token_ids, text, delta, finished and new_logprobs are sample
    `sample_index`'s; `output` is the prompt's, every sample so far in output.outputs)."""

    __slots__ = ("index", "new_token_ids", "text", "finished", "_output", "delta", "new_logprobs", "sample_index")

    def __init__(self, index: int, new_token_ids: list[int], text: str, finished: bool,
                 output: "RequestOutput | _PromptState", delta: str = "", new_logprobs: list | None = None,
                 sample_index: int = 0):
        self.index = index                    # position of the prompt in the call
        self.new_token_ids = new_token_ids
        self.text = text                      # all final text so far (the whole text on the finishing event)
        self.finished = finished              # this sample finished (output.finished: all of the prompt's)
        self._output = output
        self.delta = delta                    # text that became final at this event (never half a character)
        # SamplingParams.logprobs: one {token_id: Logprob} per token of new_token_ids; else None.
        self.new_logprobs = new_logprobs
        self.sample_index = sample_index      # which of the prompt's samples (output.outputs[sample_index])

    @property
    def output(self) -> RequestOutput:
        """The prompt's RequestOutput as of this event. Built when first read (most callers read
        only the increment): building one copies every token list, a cost that grows with the
        output, so building it at every event would make a stream quadratic in its length."""
        out = self._output
        if isinstance(out, _PromptState):
            out = self._output = out.build()
        return out

    def __repr__(self) -> str:
        return (f"StreamEvent(index={self.index}, new_token_ids={self.new_token_ids!r}, text={self.text!r}, "
                f"finished={self.finished}, output={self.output!r}, delta={self.delta!r}, "
                f"new_logprobs={self.new_logprobs!r}, sample_index={self.sample_index})")


class _SampleState:
    """A sample as a stream event saw it, its CompletionOutput built when first asked for. A
    request's token lists (and logprobs) only grow, so their first `num_tokens` entries are what
    they held then; what may change later is kept here."""

    __slots__ = ("r", "num_tokens", "finish_reason", "decoded", "error", "num_preemptions", "stats", "_out")

    def __init__(self, r: Request, decoded: str | None):
        self.r, self.num_tokens, self.finish_reason = r, len(r.output_token_ids), r.finish_reason
        self.decoded = decoded   # the output decoded (a stream's detokenizer had it), else None
        self.error, self.num_preemptions, self.stats = r.error, r.num_preemptions, r.stats
        self._out: CompletionOutput | None = None

    def completion(self, tokenizer) -> CompletionOutput:
        if self._out is None:
            r, n = self.r, self.num_tokens
            text = None
            if tokenizer is not None:
                decoded = self.decoded if self.decoded is not None else tokenizer.decode(r.output_token_ids[:n])
                text = cut_at_stop(decoded, r.params.stop)
            self._out = CompletionOutput(r.sample_index, r.req_id, r.output_token_ids[:n], text, self.finish_reason,
                                         self.stats, None if r.output_logprobs is None else r.output_logprobs[:n],
                                         self.error, self.num_preemptions, r.token_steps[:n],
                                         r.token_draft_positions[:n])
        return self._out


class _PromptState:
    """A prompt's samples as a stream event saw them: its RequestOutput, built when first read
    (StreamEvent.output)."""

    __slots__ = ("first", "samples", "num_prompt_logprobs", "num_cached_tokens", "tokenizer")

    def __init__(self, first: Request, samples: "list[_SampleState]", tokenizer):
        self.first, self.samples, self.tokenizer = first, samples, tokenizer
        self.num_prompt_logprobs = None if first.prompt_logprobs is None else len(first.prompt_logprobs)
        self.num_cached_tokens = first.num_cached_tokens

    def build(self) -> RequestOutput:
        outs = [s.completion(self.tokenizer) for s in self.samples]
        first, o = self.first, outs[0]
        return RequestOutput(first.req_id, list(first.prompt_token_ids), o.token_ids, o.text,
                             o.finish_reason, o.spec_stats, o.error, o.num_preemptions,
                             o.token_steps, o.token_draft_positions, self.tokenizer, o.logprobs,
                             None if self.num_prompt_logprobs is None
                             else first.prompt_logprobs[:self.num_prompt_logprobs], outs,
                             num_cached_tokens=self.num_cached_tokens)


class LLM:
    def __init__(self, model: str | Path, *, num_spec: int = 0, draft_model: str | Path | None = None,
                 max_num_seqs: int = 8,
                 max_model_len: int | None = None, dtype="auto", device=None,
                 enforce_eager: bool = False, seed: int = 0, block_size: int = 16,
                 num_blocks: int | None = None, num_state_slots: int | None = None,
                 kv_cache_memory: int | None = None, state_cache_memory: int | None = None,
                 gpu_memory_utilization: float | None = None, memory_budget: int | None = None,
                 max_num_batched_tokens: int = 2048,
                 graph_sizes: Sequence[int] | None = None,
                 cudagraph_capture_sizes: Sequence[int] | None = None,
                 attn_backend: str | None = None, tensor_parallel_size: int | None = None,
                 load_format: str = "safetensors", num_threads: int | None = None,
                 keep_fp8: bool | None = None, recycle_sliding_kv: bool = True,
                 enable_prefix_caching: bool = True, prefix_snapshot_interval: int | None = None,
                 num_prefix_snapshots: int | None = None, compile: str | None = None,
                 compile_after: int | None = None, compile_cache_dir: str | Path | None = None,
                 draft_dtype=None, num_scheduler_steps: int = 1):
        """Load `model` (a checkpoint directory, a hub id or a built-in name) and build its
        engine (mtpkit/engine/build.py). Every keyword is an engine argument, documented on
        mtpkit.engine.args.EngineArgs. A configuration that cannot work is a ConfigError raised
        before any weight is read."""
        args = EngineArgs(
            num_spec=num_spec, draft_model=draft_model, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            dtype=dtype, device=device, enforce_eager=enforce_eager, seed=seed, block_size=block_size,
            num_blocks=num_blocks, num_state_slots=num_state_slots, kv_cache_memory=kv_cache_memory,
            state_cache_memory=state_cache_memory, gpu_memory_utilization=gpu_memory_utilization,
            memory_budget=memory_budget, max_num_batched_tokens=max_num_batched_tokens, graph_sizes=graph_sizes,
            cudagraph_capture_sizes=cudagraph_capture_sizes, attn_backend=attn_backend,
            tensor_parallel_size=tensor_parallel_size, load_format=load_format, num_threads=num_threads,
            keep_fp8=keep_fp8, recycle_sliding_kv=recycle_sliding_kv, enable_prefix_caching=enable_prefix_caching,
            prefix_snapshot_interval=prefix_snapshot_interval, num_prefix_snapshots=num_prefix_snapshots,
            compile=compile, compile_after=compile_after, compile_cache_dir=compile_cache_dir,
            draft_dtype=draft_dtype, num_scheduler_steps=num_scheduler_steps)
        ckpt = open_checkpoint(model, load_format)
        self.model_path, self.model_config = ckpt.path, ckpt.config
        self.tokenizer = load_tokenizer(ckpt.path, ckpt.config.vocab_size)  # a broken file is named before weights load
        self.generation_defaults = read_generation_defaults(ckpt.path, ckpt.config, self.tokenizer)
        self._chat_template, self._special_tokens = load_chat_template(ckpt.path), special_tokens(ckpt.path)
        self.engine = build_engine(ckpt, args)
        self.eos_token_ids = self.generation_defaults.eos_token_ids
        self._grammars = None   # structured outputs' compiler, built on the first request that asks

    # help(LLM) shows what each keyword does: the arguments' documentation lives with them.
    if __init__.__doc__ and EngineArgs.__doc__:   # (None under python -OO)
        __init__.__doc__ = inspect.cleandoc(__init__.__doc__) + "\n\n" + inspect.cleandoc(EngineArgs.__doc__)

    # ---- the engine's state, read through the facade ---------------------------------
    engine_config = property(lambda self: self.engine.engine_config)
    memory_plan = property(lambda self: self.engine.memory_plan, doc="the pools' plan under a memory budget, or None")
    device = property(lambda self: self.engine.device)
    dtype = property(lambda self: self.engine.dtype)
    # Read by tests, benchmarks and the README's recipes (llm.runner.graphs.trace_after = 0,
    # llm.kv_pool_sizes); the engine owns them.
    model = property(lambda self: self.engine.model)
    drafter = property(lambda self: self.engine.drafter)
    draft = property(lambda self: self.engine.draft)
    tp = property(lambda self: self.engine.tp)
    cache = property(lambda self: self.engine.cache)
    kv_pools = property(lambda self: self.engine.kv_pools)
    kv_pool_sizes = property(lambda self: self.engine.kv_pool_sizes)
    slots = property(lambda self: self.engine.slots)
    scheduler = property(lambda self: self.engine.scheduler)
    runner = property(lambda self: self.engine.runner)

    @property
    def stats(self) -> SpecStats:
        """Speculation statistics of every request finished so far (assignable: a fresh
        SpecStats starts a new count), with the prefix cache's counters now
        (`.prefix_cache`: hit rate, evictions, cached blocks; None when caching is off)."""
        self.engine.stats.prefix_cache = self.engine.prefix_cache_stats()
        return self.engine.stats

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block and state snapshot. Returns False, changing nothing,
        while requests are queued or running (as vLLM does); True once done."""
        return self.engine.reset_prefix_cache()

    @stats.setter
    def stats(self, value: SpecStats) -> None:
        self.engine.stats = value

    # ---- inputs ---------------------------------------------------------------------
    def _tokens(self, prompt: Prompt, where: str) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InputError(f"{where}: this checkpoint has no tokenizer.json; pass token ids")
            ids = self.tokenizer.encode(utf8_text(prompt, where)).ids
        else:
            ids, bad, not_ints = [], [], []
            for t in id_sequence(prompt, where):  # Python, numpy and torch integers; not bools or floats
                try:
                    if is_bool(t):
                        raise TypeError
                    t = operator.index(t)
                except TypeError:
                    bad.append(t), not_ints.append(type(t).__name__)
                    continue
                ids.append(t)
                if not 0 <= t < self.model_config.vocab_size:
                    bad.append(t)
            if bad:
                raise InputError(f"{where}: token ids {bad[:8]} are outside the vocabulary "
                                 f"0..{self.model_config.vocab_size - 1}" + (
                                     f" (token ids are integers, not {', '.join(sorted(set(not_ints)))})"
                                     if not_ints else ""))
        if not ids:
            raise InputError(f"{where}: the prompt is empty; give at least one token")
        return ids

    def _validate(self, prompt: Prompt, params: SamplingParams | None, where: str
                  ) -> tuple[list[int], SamplingParams]:
        """The prompt's token ids and its SamplingParams (scalars as Python values), or an
        InputError naming `where`."""
        try:  # no SamplingParams: the checkpoint's generation_config.json defaults
            params = normalize_sampling_params(params if params is not None else self.generation_defaults.sampling_params())
            params = self._encode_bad_words(params)
            params.validate(self.model_config.vocab_size, self.eos_token_ids)
        except InputError as e:
            raise InputError(f"{where}: {e}") from None
        if params.stop and self.tokenizer is None:
            raise InputError(f"{where}: stop strings need the checkpoint's tokenizer.json, which this one lacks; "
                             "use stop_token_ids")
        if params.structured_outputs is not None:
            try:
                self._grammar_compiler().compile(params.structured_outputs)   # cached per distinct spec
            except InputError as e:
                raise InputError(f"{where}: {e}") from None
        # A prompt's samples are admitted together (seats and state slots for all; the state
        # pool holds max_num_seqs requests, engine/build.py checks): they must fit at once.
        seqs = self.engine_config.max_num_seqs
        if params.n > seqs:
            raise InputError(f"{where}: n={params.n} samples run together but max_num_seqs={seqs}; "
                             f"lower n or raise max_num_seqs to at least {params.n}")
        ids = self._tokens(prompt, where)
        total, limit = len(ids) + params.max_tokens, self.engine_config.max_model_len
        if total > limit:
            raise InputError(f"{where}: {len(ids)} prompt tokens + max_tokens={params.max_tokens} = {total} "
                             f"exceeds max_model_len={limit}; shorten the prompt, lower max_tokens or "
                             "raise max_model_len")
        return ids, params

    def _grammar_compiler(self):
        """The structured outputs' compiler over the tokenizer (llguidance's view of it, built once)."""
        if self.tokenizer is None:
            raise InputError("structured_outputs need the checkpoint's tokenizer.json, which this one lacks")
        if self._grammars is None:
            from mtpkit.structured.compiler import GrammarCompiler
            from mtpkit.structured.tokenizer_view import grammar_tokenizer
            self._grammars = GrammarCompiler(grammar_tokenizer(self.tokenizer, self.model_config.vocab_size,
                                                               self.eos_token_ids))
        return self._grammars

    def _encode_bad_words(self, params: SamplingParams) -> SamplingParams:
        """bad_words given as strings, as token-id sequences: the string's encoding and, as
        vLLM does, that of the string after a space when it differs (a word inside a line)."""
        words = params.bad_words
        if not isinstance(words, list) or not any(isinstance(w, str) for w in words):
            return params
        if self.tokenizer is None:
            raise InputError("bad_words strings need the checkpoint's tokenizer.json, which this one lacks; "
                             "give token-id lists")
        ids = []
        for w in words:
            if not isinstance(w, str):
                ids.append(w)
                continue
            for text in dict.fromkeys([w, " " + w.lstrip()]):
                enc = self.tokenizer.encode(text, add_special_tokens=False).ids
                if enc and enc not in ids:
                    ids.append(enc)
        return dataclasses.replace(params, bad_words=ids)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, *,
                    where: str = "prompt") -> Request:
        """Validate and queue one request (raises InputError; queued requests are unaffected)."""
        return self._enqueue(*self._validate(prompt, params, where))

    def _enqueue(self, ids: list[int], params: SamplingParams) -> Request:
        """Queue an already validated request."""
        matcher = StopStringMatcher(self.tokenizer, params.stop) if params.stop else None
        new_grammar = (None if params.structured_outputs is None   # a matcher per request (per sample)
                       else functools.partial(self._grammar_compiler().request_grammar, params.structured_outputs))
        return self.engine.add(ids, params, eos_token_ids=() if params.ignore_eos else self.eos_token_ids,
                               stop_matcher=matcher, new_grammar=new_grammar)

    # ---- running --------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one engine step; returns the requests it advanced."""
        return self.engine.step()

    def abort(self, request_ids: int | Sequence[int]) -> list[int]:
        """Stop requests now: they leave the queue, their KV blocks and state slots are freed,
        and they finish with finish_reason "abort" (a stream that holds one yields it as
        finished). request_ids: RequestOutput.request_id / Request.req_id values. Ids that are
        unknown or already finished are ignored, so aborting twice is harmless; returns the
        ids that were aborted."""
        try:
            ids = ({operator.index(request_ids)} if isinstance(request_ids, numbers.Integral)
                   else {operator.index(i) for i in request_ids})
        except TypeError:
            raise InputError(f"request_ids={short_repr(request_ids)} must be an id or a list of ids "
                             "(RequestOutput.request_id, Request.req_id)") from None
        return self.engine.abort_ids(ids)

    def _prepare(self, prompts, sampling_params, errors: str):
        prompts = prompt_list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise InputError(f"{len(sampling_params)} SamplingParams for {len(prompts)} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params] * len(prompts)
        if errors not in ("raise", "return"):
            raise InputError(f"errors={errors!r} must be 'raise' or 'return'")
        # Validate every prompt before queueing any, so a bad one costs no model work.
        problems, valid = {}, {}
        for i, (p, sp) in enumerate(zip(prompts, params)):
            try:
                valid[i] = self._validate(p, sp, "prompt" if len(prompts) == 1 else f"prompt {i}")
            except InputError as e:
                problems[i] = str(e)
        if problems and errors == "raise":
            if len(prompts) == 1:
                raise InputError(problems[0])
            shown = list(problems.values())[:MAX_LISTED]
            more = len(problems) - len(shown)
            raise InputError(f"{len(problems)} of {len(prompts)} prompts are bad; nothing was run (pass "
                             "errors='return' to run the valid prompts and get the errors back as outputs):\n  "
                             + "\n  ".join(shown) + (f"\n  ... and {more} more" if more else ""))
        reqs = {}
        try:
            for i, (ids, sp) in valid.items():
                reqs[i] = self._enqueue(ids, sp)
        except BaseException:  # all or nothing: an interrupt here leaves no request queued
            with interrupts.held("redeliver"):   # nor does a second one
                self.engine.abort(list(reqs.values()))
            raise
        return prompts, reqs, problems

    def stream(self, prompts, sampling_params=None, *, errors: str = "raise") -> Iterator[StreamEvent]:
        """Yield each request's new tokens after every step, until all have finished. If the
        generator is closed or collected early, or a step raises (KeyboardInterrupt included),
        this call's requests are aborted: their storage is freed and none of them runs later."""
        prompts, reqs, problems = self._prepare(prompts, sampling_params, errors)
        try:
            for i, msg in problems.items():
                yield StreamEvent(i, [], "", True, self._error_output(prompts[i], msg))
            samples = [s for r in reqs.values() for s in (r.samples or [r])]
            index = {s.req_id: i for i, r in reqs.items() for s in (r.samples or [r])}
            seen = {r.req_id: 0 for r in samples}
            detok = {r.req_id: IncrementalDetokenizer(self.tokenizer, stop=r.params.stop) for r in samples}
            live = {r.req_id: r for r in samples}
            states = {}   # each sample's last _SampleState (a new one when it changes)
            while live:
                # The step this caller ran, or the one another caller was running (Engine.advance).
                stepped = [r for r in self.engine.advance() if r.req_id in live]
                # Requests that another step advanced or that were aborted (LLM.abort) since this
                # caller last looked, and are in no step it saw: report them too (none when the
                # step advanced every live one, as in a steady batch).
                others = []
                if len(stepped) < len(live):
                    stepped_ids = {r.req_id for r in stepped}
                    others = [r for r in live.values() if r.req_id not in stepped_ids and
                              (r.status == Status.FINISHED or len(r.output_token_ids) > seen[r.req_id])]
                for r in stepped + others:
                    if r.req_id not in live:
                        continue
                    # read before yielding: the caller may abort r meanwhile, which must still be
                    # reported on the next round. The status first: another caller's step may
                    # run meanwhile, and a request read as finished has all its tokens.
                    finished = r.status == Status.FINISHED
                    new = r.output_token_ids[seen[r.req_id]:]
                    if new or finished:
                        start, seen[r.req_id] = seen[r.req_id], len(r.output_token_ids)
                        new_lps = None
                        if r.output_logprobs is not None:
                            new_lps = self._decode_logprobs(r.output_logprobs[start:seen[r.req_id]])
                        if start == 0 and r.prompt_logprobs is not None:  # complete once a token is out
                            self._decode_logprobs(r.prompt_logprobs[1:])
                        d = detok[r.req_id]
                        delta = d.add(new, final=finished)
                        yield StreamEvent(index[r.req_id], new, d.text, finished, self._state(r, states, detok),
                                          delta, new_lps, r.sample_index)
                    if finished:
                        del live[r.req_id]
        finally:
            # Uncut by a second Ctrl-C, and run by the collector for an abandoned stream, maybe
            # in the main thread during another call: a Ctrl-C held here goes back to the main
            # thread afterwards (engine/interrupts.py).
            with interrupts.held("redeliver"):
                self.engine.abort([s for r in reqs.values() for s in (r.samples or [r])])

    def generate(self, prompts, sampling_params=None, *, errors: str = "raise",
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order (SamplingParams.n samples of it in .outputs).
        prompts: a str, a list of token ids, or a
        list of those (see prompt_list). errors='raise' refuses the whole call if any prompt
        is bad (before any model work); errors='return' runs the others and returns the bad
        ones with .error set. An exception (KeyboardInterrupt included) aborts the call's
        requests before it propagates."""
        outputs: dict[int, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(desc="generating", unit="tok")
        # closing: an exception here would otherwise keep the stream (and its requests) alive
        # in the traceback until it is collected.
        with contextlib.closing(self.stream(prompts, sampling_params, errors=errors)) as events:
            for ev in events:
                if bar is not None:
                    bar.update(len(ev.new_token_ids))
                # (an output is built only where a sample finished: StreamEvent.output)
                if ev.finished and ev.output.finished:   # every sample of the prompt
                    outputs[ev.index] = ev.output
        if bar is not None:
            bar.close()
        return [outputs[i] for i in sorted(outputs)]

    # ---- asyncio: each call on a thread of its own, never on the event loop (engine/loop.py)
    def _check_async(self) -> None:
        if self.engine.tp.size > 1 and self.engine.leader is None:
            raise InputError("asyncio calls under tensor parallelism need rank 0 to lead: `with llm.lead():` on "
                             "rank 0 and `llm.follow()` on the other ranks (else every rank must make the same "
                             "calls in the same order, from one thread)")

    async def agenerate(self, prompts, sampling_params=None, **kwargs) -> list[RequestOutput]:
        """`await llm.agenerate(...)`: generate() with the same arguments, run on a thread of its
        own, batched with every other call in flight. Cancelling the awaiting task aborts this
        call's requests (freed when the cancellation returns)."""
        self._check_async()
        return await run_call(lambda: self.generate(prompts, sampling_params, **kwargs), self.engine.abort)

    async def achat(self, messages, sampling_params=None, **kwargs) -> list[RequestOutput]:
        """`await llm.achat(...)`: chat() with the same arguments, as agenerate runs generate()."""
        self._check_async()
        return await run_call(lambda: self.chat(messages, sampling_params, **kwargs), self.engine.abort)

    def astream(self, prompts, sampling_params=None, *, errors: str = "raise") -> AsyncIterator[StreamEvent]:
        """`async for ev in llm.astream(...)`: stream()'s events, the stream run on a thread of its
        own. Cancelling the task or closing the iterator early (aclose) aborts this call's
        requests; a bad input raises at the first event, before anything is queued."""
        self._check_async()
        return stream_call(lambda: self.stream(prompts, sampling_params, errors=errors), self.engine.abort)

    def apply_chat_template(self, messages, *, add_generation_prompt: bool = True, chat_template: str | None = None,
                            tokenize: bool = True, **template_kwargs) -> list:
        """Each conversation of `messages` (a list of {"role", "content"} dicts, or a list of
        such lists) rendered by the checkpoint's chat template (or `chat_template`: a template
        or the name of one of the checkpoint's), as token ids (tokenize=True) or text; one
        entry per conversation. Extra keyword arguments are template variables."""
        from mtpkit.text.chat import conversation_list, render_chat, select_template
        source = select_template(self._chat_template, chat_template, str(self.model_path))
        convs = conversation_list(messages)
        where = (lambda i: f"conversation {i}") if len(convs) > 1 else (lambda i: "conversation")
        texts = [render_chat(source, c, add_generation_prompt=add_generation_prompt, special=self._special_tokens,
                             where=where(i), **template_kwargs) for i, c in enumerate(convs)]
        if not tokenize:
            return texts
        if self.tokenizer is None:
            raise InputError("this checkpoint has no tokenizer.json to encode the rendered chat; pass tokenize=False")
        # the template writes the special tokens itself
        return [self.tokenizer.encode(t, add_special_tokens=False).ids for t in texts]

    def chat(self, messages, sampling_params=None, *, add_generation_prompt: bool = True,
             chat_template: str | None = None, chat_template_kwargs: dict | None = None,
             errors: str = "raise", use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate a reply to each conversation (a list of message dicts, or a list of
        conversations): rendered by apply_chat_template, then generate(); one RequestOutput per
        conversation. Without sampling_params the checkpoint's generation_config.json defaults
        apply. Every conversation is rendered before any runs."""
        ids = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                       chat_template=chat_template, **(chat_template_kwargs or {}))
        return self.generate(ids if len(ids) > 1 else ids[0], sampling_params, errors=errors, use_tqdm=use_tqdm)

    def _state(self, r: Request, seen: dict, detoks: dict[int, IncrementalDetokenizer]) -> _PromptState:
        """r's prompt as of now (StreamEvent.output builds its RequestOutput when first read).
        `seen` keeps each sample's last state, reused while it has neither new tokens nor an end
        (its CompletionOutput then built once); `detoks`: the stream's detokenizers, whose decoded
        text is a sample's when they have taken all its tokens."""
        samples = []
        for s in r.samples or [r]:
            last = seen.get(s.req_id)
            if last is None or last.num_tokens != len(s.output_token_ids) or last.finish_reason != s.finish_reason:
                d = detoks.get(s.req_id)
                last = seen[s.req_id] = _SampleState(
                    s, d.decoded if d is not None and len(d.token_ids) == len(s.output_token_ids) else None)
            samples.append(last)
        return _PromptState((r.samples or [r])[0], samples, self.tokenizer)

    def _decode_logprobs(self, entries: list) -> list:
        """Fill each Logprob's decoded_token (the token's text alone), once per entry; returns entries."""
        if self.tokenizer is None:
            return entries
        cache = self.__dict__.setdefault("_token_texts", {})
        for d in entries:
            for t, lp in (d or {}).items():
                if lp.decoded_token is None:
                    if t not in cache:
                        cache[t] = self.tokenizer.decode([t])
                    lp.decoded_token = cache[t]
        return entries

    def _error_output(self, prompt, msg: str) -> RequestOutput:
        try:  # the ids as far as they can be read: a bad prompt may be anything
            ids = [] if isinstance(prompt, str) else id_sequence(prompt, "")
        except InputError:
            ids = []
        return RequestOutput(self.engine.next_id(), ids, [], "", "error", SpecStats(), msg)

    # ---- tensor parallelism: rank 0 leads, the other ranks follow (engine/follow.py) ----
    @contextlib.contextmanager
    def lead(self):
        """`with llm.lead():` on rank 0 of a tensor-parallel group, while the other ranks call
        `llm.follow()`: inside the block rank 0 alone makes calls, from any number of threads,
        asyncio tasks or `mtpkit serve`, and the other ranks replay what changes the schedule
        (queued requests, aborts, steps, scores). Leaving the block aborts what is still
        queued or running and ends the followers' `follow()`; then every rank makes the same
        calls again. Without tensor parallelism it does nothing."""
        if self.tp.size > 1:
            if self.tp.rank != 0:
                raise InputError(f"lead() is rank 0's; rank {self.tp.rank} calls llm.follow()")
            self.engine.lead(True)
        try:
            yield self
        finally:
            if self.tp.size > 1 and not self.engine.closed:
                self.engine.lead(False)

    def follow(self) -> str:
        """On a tensor-parallel rank other than 0: run what rank 0 runs inside its `lead()`
        block, until it leaves the block (returns "end") or closes its LLM ("close": this one
        is closed too). Meanwhile this LLM takes no call from another thread (InputError)."""
        if self.tp.size == 1:
            raise InputError("follow() is for tensor-parallel ranks other than 0; this LLM runs alone")
        if self.tp.rank == 0:
            raise InputError("rank 0 leads (`with llm.lead():`); the other ranks call follow()")
        return follow_ops(self.engine, self._enqueue)

    # ---- closing --------------------------------------------------------------------
    def close(self) -> None:
        """Free the engine now (its requests are aborted, its caches and graphs dropped) and
        give back torch's process-wide thread count if this LLM changed it (a small model
        sets 1 thread on CPU: see EngineArgs.num_threads). Also done when the LLM is
        collected, or at the end of `with LLM(...) as llm:`. Calls after close raise."""
        engine = self.__dict__.get("engine")
        if engine is not None:
            with interrupts.held():   # a Ctrl-C meanwhile is raised once it is closed
                engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            # The collector may run this in the main thread during another call: a Ctrl-C
            # landing here goes back to that call (engine/interrupts.py), not into the void.
            with interrupts.held("redeliver"):
                self.close()
        except Exception:   # noqa: BLE001 - interpreter shutdown: nothing left to give back
            pass

    # ---- scoring --------------------------------------------------------------------
    def score(self, token_ids: Sequence[int]) -> torch.Tensor:
        """fp32 logits [seq, vocab] of every position of one sequence, through the engine's
        (chunked) prefill path."""
        return self.engine.score(self._tokens(token_ids, "score"))
