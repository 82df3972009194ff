"""The streaming view: watch speculation happen, one panel per request.

`watch(llm, prompts, params)` streams the call through `LLM.stream` and shows, per request,
the text as steps complete with every token coloured by origin (an accepted draft of position
j, or the target's own token), live acceptance bars per draft position, tokens/s, and a Stop
button. It returns the RequestOutputs, like `generate`.

Stopping: the Stop button calls `LLM.abort` on the view's requests, which frees their storage
at once; the stream then reports them finished with "abort" and the view shows what they had
generated. The notebook's interrupt (a KeyboardInterrupt inside the call) closes the stream,
which aborts the same way; `watch` then returns the outputs so far instead of raising.
A cell that runs `watch` blocks the kernel's main thread; stop_channel.py says how the
click gets through anyway.

Outside a notebook (no kernel, or ipywidgets missing) it prints the text and a stats line.
"""

import contextlib
import dataclasses
import threading
import time

from mtpkit.text.detokenize import IncrementalDetokenizer
from mtpkit.engine.request import RequestOutput, SpecStats
from mtpkit.notebook import html as H
from mtpkit.notebook.stop_channel import route_to_subshell, ui_poll


def in_notebook() -> bool:
    """A Jupyter kernel is running this code and ipywidgets can be imported."""
    try:
        from IPython import get_ipython
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def _merged(outputs) -> SpecStats:
    total = SpecStats()
    for o in outputs:
        if o is not None:
            total.merge(o.spec_stats)
    return total


class _Panel:
    """One request: its header and coloured text, built up span by span."""

    def __init__(self, widgets, index: int, prompt: str, tokenizer):
        self.index, self.prompt, self.spans, self.status, self.dirty = index, prompt, [], "waiting", False
        self.detok = IncrementalDetokenizer(tokenizer)
        self.tokenizer = tokenizer
        self.header = widgets.HTML(self._header("waiting", 0))
        self.text = widgets.HTML(H.text_block(prompt, ""))
        self.box = widgets.VBox([self.header, self.text],
                                layout=widgets.Layout(border="1px solid #ddd", padding="4px", margin="2px 0"))
        self.box.add_class("mtp-panel")

    def _header(self, status: str, n: int) -> str:
        return f'<div style="font-size:11px;color:#555">prompt {self.index} · {n} tokens · {status}</div>'

    def add(self, out: RequestOutput, new: list[int]) -> None:
        start = len(out.token_ids) - len(new)
        for k, t in enumerate(new):
            i = start + k
            last = out.finished and i == len(out.token_ids) - 1
            piece = self.detok.add([t], final=last) if self.tokenizer is not None else f"[{t}]"
            lps = None if out.logprobs is None else [out.logprobs[i]]
            self.spans.append(H.token_spans([t], [piece], [out.token_steps[i]], [out.token_draft_positions[i]], lps))
        self.status, self.dirty = out.finish_reason or "running", True

    def draw(self) -> None:
        # Redrawn at the view's refresh rate, not per step: the whole text is resent each
        # time, which per step would grow quadratically with a long generation.
        if self.dirty:
            self.header.value = self._header(self.status, len(self.spans))
            self.text.value = H.text_block(self.prompt, "".join(self.spans))
            self.dirty = False


class SpecView:
    """The widgets of one `watch` call: panels, acceptance bars, tokens/s, the Stop button.
    Kept as `mtpkit.notebook.view.last_view` so a later cell (or a test) can read them."""

    def __init__(self, llm, prompts: list, refresh: float = 0.1):
        import ipywidgets as widgets

        self.llm, self.refresh = llm, refresh
        tok = llm.tokenizer
        texts = [p if isinstance(p, str) else (tok.decode(list(p)) if tok is not None else str(list(p)))
                 for p in prompts]
        self.panels = [_Panel(widgets, i, t, tok) for i, t in enumerate(texts)]
        self.request_ids: set[int] = set()
        self.stopped = False
        self.stop_button = widgets.Button(description="Stop", button_style="danger", icon="stop")
        self.stop_button.on_click(self._on_stop)
        self.rate = widgets.HTML("")
        self.bars = widgets.HTML(H.acceptance_bars(SpecStats(num_spec=llm.engine_config.num_spec)))
        legend = widgets.HTML(f'<div style="font-size:11px">{H.legend(llm.engine_config.num_spec)}</div>')
        top = widgets.HBox([self.stop_button, self.rate])
        self.widget = widgets.VBox([top, legend, self.bars, *[p.box for p in self.panels]])
        self.widget.add_class("mtp-view")
        self._last_refresh, self._t0, self._num_tokens = 0.0, time.perf_counter(), 0

    def _on_stop(self, _button=None) -> None:
        # On the main thread (between steps) storage is freed here, at the click. A click
        # handled on a kernel subshell (stop_channel) only sets the flag: watch() aborts on
        # the main thread after the current step. Requests still queued hold no storage;
        # watch() aborts them by closing its stream.
        self.stopped = True
        if threading.current_thread() is threading.main_thread():
            self.abort()

    def abort(self) -> None:
        self.llm.abort(sorted(self.request_ids))

    def update(self, ev, latest: list) -> None:
        if ev.output.request_id >= 0 and not ev.finished:   # Stop aborts every sample
            self.request_ids.add(ev.output.outputs[ev.sample_index].request_id)
        self._num_tokens += len(ev.new_token_ids)
        if ev.sample_index == 0:   # a panel shows a prompt's first sample (SamplingParams.n)
            self.panels[ev.index].add(ev.output, ev.new_token_ids)
        now = time.perf_counter()
        if now - self._last_refresh >= self.refresh or all(o is not None and o.finished for o in latest):
            self.refresh_stats(latest)

    def refresh_stats(self, latest: list, status: str = "") -> None:
        for p in self.panels:
            p.draw()
        self._last_refresh = now = time.perf_counter()
        elapsed = max(now - self._t0, 1e-9)
        self.rate.value = (f'<span class="mtp-rate" style="font-size:12px;margin-left:8px">'
                           f'{self._num_tokens} tokens · {self._num_tokens / elapsed:.1f} tok/s{(" · " + status) if status else ""}</span>')
        stats = _merged(latest)
        stats.num_spec = max(stats.num_spec, self.llm.engine_config.num_spec)
        self.bars.value = H.acceptance_bars(stats)

    def finish(self, outputs: list, status: str) -> None:
        self.stop_button.disabled = True
        for p, o in zip(self.panels, outputs):
            p.status, p.dirty = o.finish_reason, True
        self.refresh_stats(outputs, status)


last_view: SpecView | None = None


def watch(llm, prompts, sampling_params=None, *, display: bool | None = None,
          refresh: float = 0.1) -> list[RequestOutput]:
    """Generate like `llm.generate(prompts, sampling_params)` and show it as it happens.
    display: True draws the widget view, False prints plain text, None (default) chooses the
    view inside a notebook with ipywidgets. refresh: seconds between redraws of the bars and
    tokens/s (the text is redrawn every step). Returns one RequestOutput per prompt, in order;
    a stopped or interrupted call returns its requests with finish_reason "abort"."""
    from mtpkit.engine.inputs import prompt_list

    prompts = prompt_list(prompts)
    _check(llm, prompts, sampling_params)   # bad input is refused before the view is drawn
    if display is None:
        display = in_notebook()
    if not display:
        return _watch_plain(llm, prompts, sampling_params)
    global last_view
    from IPython.display import display as show

    view = last_view = SpecView(llm, prompts, refresh)
    show(view.widget)
    polling = contextlib.nullcontext(lambda n: None)
    if in_notebook() and not route_to_subshell(view.stop_button):
        polling = ui_poll()
    latest: list = [None] * len(prompts)
    status = "done"
    try:
        with polling as poll, contextlib.closing(llm.stream(prompts, sampling_params)) as events:
            for ev in events:
                latest[ev.index] = ev.output
                view.update(ev, latest)
                poll(20)
                if view.stopped:   # closing the stream aborts what the button could not see yet
                    view.abort()
                    break
    except KeyboardInterrupt:
        status = "interrupted"   # the stream was closed: its requests are aborted
    if view.stopped:
        status = "stopped"
    outputs = _final(llm, prompts, latest)
    view.finish(outputs, status)
    return outputs


def _check(llm, prompts: list, sampling_params) -> None:
    """The call's input errors, as LLM.stream would raise them (it checks again)."""
    from mtpkit.errors import InputError

    params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
    if len(params) != len(prompts):
        raise InputError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
    problems = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        try:
            llm._validate(p, sp, f"prompt {i}")
        except InputError as e:
            problems.append(str(e))
    if problems:
        raise InputError("; ".join(problems) + ("" if len(prompts) == 1 else " (nothing was run)"))


def _final(llm, prompts, latest: list) -> list[RequestOutput]:
    """Each prompt's last output; those cut off by an interrupt finish with "abort"."""
    outputs = []
    for p, o in zip(prompts, latest):
        if o is None:   # never started: still queued when the call stopped
            ids = llm.tokenizer.encode(p).ids if isinstance(p, str) and llm.tokenizer else list(p)
            o = RequestOutput(-1, ids, [], "", "abort", SpecStats())
        elif not o.finished:   # and each of its samples cut off (SamplingParams.n)
            samples = [c if c.finished else dataclasses.replace(c, finish_reason="abort") for c in o.outputs]
            o = dataclasses.replace(o, finish_reason=o.finish_reason or "abort", outputs=samples)
        outputs.append(o)
    return outputs


def stats_line(outputs: list[RequestOutput], seconds: float) -> str:
    n = sum(len(o.token_ids) for o in outputs)
    s = _merged(outputs)
    rates = ", ".join(f"{r:.2f}" for r in s.acceptance_rate_per_position)
    cached = sum(o.num_cached_tokens for o in outputs)
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    return (f"{n} tokens in {seconds:.2f} s ({n / max(seconds, 1e-9):.1f} tok/s) · mean acceptance length "
            f"{s.mean_acceptance_length:.2f} · acceptance per draft position [{rates}]"
            + (f" · prefix cache: {cached}/{prompt} prompt tokens" if cached else ""))


def _watch_plain(llm, prompts, sampling_params) -> list[RequestOutput]:
    t0, latest = time.perf_counter(), [None] * len(prompts)
    single = len(prompts) == 1
    try:
        with contextlib.closing(llm.stream(prompts, sampling_params)) as events:
            for ev in events:
                latest[ev.index] = ev.output
                if ev.sample_index:   # the first sample of each prompt is shown (SamplingParams.n)
                    continue
                if single:
                    print(ev.delta, end="", flush=True)
                elif ev.finished:
                    print(f"[{ev.index}] {ev.text}")
    except KeyboardInterrupt:
        print("\n(interrupted: the call's requests were aborted)")
    outputs = _final(llm, prompts, latest)
    if single:
        print()
    print(stats_line(outputs, time.perf_counter() - t0))
    return outputs
