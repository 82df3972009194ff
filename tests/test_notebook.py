"""The notebook experience: token origins in RequestOutput, the streaming view (its recorded
widget state against the outputs and LLM.stats), the Stop button and the notebook interrupt,
the rich displays, and the two example notebooks executed headless."""

import html
import html.parser
import re
import json
from pathlib import Path

import pytest
import torch

import mtpkit
from mtpkit import LLM, SamplingParams
from mtpkit.notebook import view as nbview

# the TP notebook's notebook_launcher meets on a fixed port: this file takes turns with the others (conftest)
pytestmark = pytest.mark.fixed_port

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["def fibonacci(n):", "class Stack:\n    def push(self, item):", "import os\n"]


class _Spans(html.parser.HTMLParser):
    """The token spans of a view panel / RequestOutput HTML: (text, step, draft) each, and the
    grey prompt span."""

    def __init__(self, markup: str):
        super().__init__()
        self.tokens, self.prompt, self._cur = [], None, None
        self.feed(markup)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "span" and "mtp-tok" in a.get("class", ""):
            self._cur = [ "", int(a["data-step"]), int(a["data-draft"])]
        elif tag == "span" and "color:#888" in a.get("style", ""):
            self._cur = "prompt"
            self.prompt = ""

    def handle_data(self, data):
        if self._cur == "prompt":
            self.prompt += data
        elif self._cur is not None:
            self._cur[0] += data

    def handle_endtag(self, tag):
        if tag == "span" and self._cur is not None:
            if self._cur != "prompt":
                self.tokens.append(tuple(self._cur))
            self._cur = None


def _pools(llm):
    return llm.kv_pools.num_free, llm.slots.num_free


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-qwen3-next", num_spec=3)


@pytest.fixture(scope="module")
def fresh_outputs():
    """What a fresh engine generates for PROMPTS (the reference after a stop)."""
    return [o.token_ids for o in LLM("tiny-qwen3-next", num_spec=3).generate(PROMPTS, SamplingParams(max_tokens=40))]


# ---- token origins ---------------------------------------------------------------------
@pytest.mark.parametrize("num_spec", [0, 3])
def test_token_origins_follow_the_verify_steps(num_spec):
    engine = LLM("tiny-qwen3-next", num_spec=num_spec)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=37, ignore_eos=True))
    for o in outs:
        assert len(o.token_steps) == len(o.token_draft_positions) == len(o.token_ids) == 37
        # step 0 (the prompt's prefill) emits one target token; each later step emits its
        # accepted drafts 1..a-1 in order, then one target token.
        assert o.token_steps[0] == 0 and o.token_draft_positions[0] == 0
        steps = sorted(set(o.token_steps))
        assert steps == list(range(len(steps)))
        for s in steps[1:]:
            pos = [d for t, d in zip(o.token_steps, o.token_draft_positions) if t == s]
            last_step = s == steps[-1]   # max_tokens may cut the final step's tokens
            assert pos[:-1] == list(range(1, len(pos))) and (pos[-1] == 0 or last_step)
            assert max(pos) <= num_spec
        assert o.num_accepted_tokens == o.spec_stats.num_accepted
        assert len(steps) - 1 == o.spec_stats.verify_steps
    if num_spec:
        assert sum(o.num_accepted_tokens for o in outs) == engine.stats.num_accepted > 0


# ---- the view --------------------------------------------------------------------------
def test_view_panels_match_outputs_and_stats(llm, fresh_outputs):
    before = llm.stats.num_accepted
    outs = nbview.watch(llm, PROMPTS, SamplingParams(max_tokens=40), display=True)
    view = nbview.last_view
    assert [o.token_ids for o in outs] == fresh_outputs
    for panel, o, prompt in zip(view.panels, outs, PROMPTS):
        spans = _Spans(panel.text.value)
        assert spans.prompt == prompt
        assert [d for _, _, d in spans.tokens] == o.token_draft_positions
        assert [s for _, s, _ in spans.tokens] == o.token_steps
        assert "".join(t for t, _, _ in spans.tokens) == o.text
        assert f"{o.finish_reason}" in panel.header.value
    accepted = sum(1 for p in view.panels for _, _, d in _Spans(p.text.value).tokens if d)
    assert accepted == llm.stats.num_accepted - before > 0
    assert view.bars.value.count('class="mtp-bar"') == 3 and "tok/s" in view.rate.value


@pytest.mark.parametrize("how", ["stop button", "interrupt"])
def test_stop_aborts_and_the_next_call_is_clean(llm, fresh_outputs, how, monkeypatch):
    free = _pools(llm)
    step, calls, at_stop = llm.engine.advance, [0], {}   # what watch()'s stream steps with

    def stepping():
        calls[0] += 1
        if calls[0] == 4 and how == "interrupt":
            raise KeyboardInterrupt   # the notebook's interrupt, inside the engine step
        done = step()
        if calls[0] == 4:
            assert _pools(llm) != free   # requests hold storage
            nbview.last_view.stop_button.click()
            at_stop["pools"] = _pools(llm)   # right after the click, before watch() returns
        return done

    monkeypatch.setattr(llm.engine, "advance", stepping)
    try:
        outs = nbview.watch(llm, PROMPTS, SamplingParams(max_tokens=40), display=True)
    except KeyboardInterrupt:
        pytest.fail("watch() let the interrupt through instead of returning what was generated")
    monkeypatch.undo()
    if how == "stop button":
        assert at_stop["pools"] == free
    assert _pools(llm) == free and not llm.scheduler.has_unfinished()
    assert all(o.finish_reason == "abort" for o in outs)
    assert any(o.token_ids for o in outs)
    for o, full in zip(outs, fresh_outputs):   # what was generated is shown, and is a prefix
        assert o.token_ids == full[:len(o.token_ids)] and len(o.token_ids) < len(full)
        spans = _Spans(nbview.last_view.panels[outs.index(o)].text.value).tokens
        assert [d for _, _, d in spans] == o.token_draft_positions
    assert "stopped" in nbview.last_view.rate.value or "interrupted" in nbview.last_view.rate.value
    assert [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=40))] == fresh_outputs


def test_plain_text_outside_a_notebook(llm, fresh_outputs, capsys):
    assert not nbview.in_notebook()
    outs = nbview.watch(llm, PROMPTS, SamplingParams(max_tokens=40))
    printed = capsys.readouterr().out
    assert [o.token_ids for o in outs] == fresh_outputs
    assert all(o.text in printed for o in outs)
    assert "tok/s" in printed and "mean acceptance length" in printed


def test_bad_input_is_refused_before_the_view(llm):
    nbview.last_view = None
    with pytest.raises(mtpkit.InputError, match="prompt 1: .*max_model_len"):
        nbview.watch(llm, ["x = 1", "y" * 10], SamplingParams(max_tokens=5000), display=True)
    assert nbview.last_view is None and not llm.scheduler.has_unfinished()


def test_no_view_without_ipywidgets(monkeypatch):
    import sys
    import types

    import IPython

    monkeypatch.setattr(IPython, "get_ipython", lambda: types.SimpleNamespace(kernel=object()))
    assert nbview.in_notebook()   # a kernel, ipywidgets importable
    monkeypatch.setitem(sys.modules, "ipywidgets", None)   # import ipywidgets now fails
    assert not nbview.in_notebook()


# ---- rich displays ---------------------------------------------------------------------
def test_logprobs_show_on_hover(llm):
    o = llm.generate("import sys\n", SamplingParams(max_tokens=8, logprobs=3))[0]
    markup = o._repr_html_()
    found = re.findall(r'<span class="mtp-tok"[^>]*data-logprob="([^"]+)" data-rank="(\d+)" title="([^"]*)"', markup)
    assert len(found) == len(o.token_ids)
    for (lp, rank, title), t, entry in zip(found, o.token_ids, o.logprobs):
        assert abs(float(lp) - entry[t].logprob) < 1e-5 and int(rank) == entry[t].rank
        title = html.unescape(title)
        assert f"logprob {entry[t].logprob:.3f} (rank {entry[t].rank})" in title and "top: " in title
        best = min(entry.values(), key=lambda x: x.rank)
        assert f"{best.decoded_token!r}: {best.logprob:.3f}" in title, title
    plain = llm.generate("import sys\n", SamplingParams(max_tokens=8))[0]._repr_html_()
    assert "data-logprob" not in plain and "logprob" not in plain
    # the live view's panels likewise
    outs = nbview.watch(llm, ["import sys\n"], SamplingParams(max_tokens=8, logprobs=3), display=True)
    live = re.findall(r'data-logprob="([^"]+)"', nbview.last_view.panels[0].text.value)
    assert [float(x) for x in live] == pytest.approx([e[t].logprob for t, e in zip(outs[0].token_ids, outs[0].logprobs)],
                                                     abs=1e-5)


def test_request_output_and_stats_html(llm):
    o = llm.generate("import sys\n", SamplingParams(max_tokens=30))[0]
    spans = _Spans(o._repr_html_())
    assert spans.prompt == "import sys\n"
    assert [(s, d) for _, s, d in spans.tokens] == list(zip(o.token_steps, o.token_draft_positions))
    assert "".join(t for t, _, _ in spans.tokens) == o.text
    bars = o.spec_stats._repr_html_()
    for j, rate in enumerate(o.spec_stats.acceptance_rate_per_position, start=1):
        assert f'data-position="{j}" data-rate="{rate:.4f}"' in bars


def test_shape_trace_html_and_filter(llm):
    llm.add_request("import sys\n", SamplingParams(max_tokens=8))
    llm.step()
    with mtpkit.debug() as trace:
        llm.step()   # one verify step
    while llm.scheduler.has_unfinished():
        llm.step()
    # (the greedy outcome of a verify step: sampling/rejection.greedy_verify, in the verify body)
    sel = trace.filter("greedy_verify", bundle=4)
    assert len(sel) == 1 and all("greedy_verify" in e.function for e in sel)
    assert len(trace.filter(num_reqs_padded=True)) < len(trace)
    assert len(trace.filter(bundle=5)) == 0
    with pytest.raises(NameError, match="not dimension names"):
        trace.filter(bundel=4)
    table = sel._repr_html_()
    head = table.split("</thead>")[0]
    for col in ("function", "num_reqs", "num_reqs_padded", "bundle", "vocab", "arguments (shape dtype)"):
        assert f">{col}<" in head
    assert "logits: (1, 4, 257) float32" in table


def test_shape_error_names_boundary_bindings_and_argument():
    from mtpkit.sampling.sampler import SamplingTensors
    from mtpkit.sampling.rejection import rejection_sample

    st = SamplingTensors.from_params([SamplingParams()] * 2, "cpu")
    with mtpkit.debug(), pytest.raises(mtpkit.ShapeError) as info:
        rejection_sample(torch.zeros(2, 4, 16), torch.zeros(2, 2, dtype=torch.long), torch.full((2,), 3), st,
                         [None, None], [5, 5])
    err = info.value
    assert err.boundary == "sampling.rejection.rejection_sample"
    assert err.argument == "drafts" and err.bindings == {"num_reqs": 2, "bundle": 4, "vocab": 16}
    page = err._repr_html_()
    assert "rejection_sample" in page and "num_reqs=2" in page and "<code>drafts</code>" in page


# ---- the example notebooks, headless ---------------------------------------------------
def _execute(name: str):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(ROOT / "examples" / name, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    return nb, outputs


def test_quickstart_notebook_view_state():
    nb, outputs = _execute("quickstart.ipynb")
    record = next(json.loads(line) for o in outputs for line in o.get("text", "").splitlines()
                  if line.startswith('{"outputs"'))
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    values = [w["state"].get("value", "") for w in state.values() if w["model_name"] == "HTMLModel"]
    panels = {}
    for v in values:
        if 'class="mtp-text"' in v:
            spans = _Spans(v)
            panels[spans.prompt] = spans.tokens
    assert sorted(panels) == sorted(PROMPTS[:2] + ["import os\n"])
    for prompt, o in zip(["def fibonacci(n):", "class Stack:\n    def push(self, item):", "import os\n"],
                         record["outputs"]):
        tokens = panels[prompt]
        assert [d for _, _, d in tokens] == o["drafts"] and [s for _, s, _ in tokens] == o["steps"]
        assert "".join(t for t, _, _ in tokens) == o["text"] and len(o["token_ids"]) == len(tokens)
    gemma = next(json.loads(line)["gemma"] for o in outputs for line in o.get("text", "").splitlines()
                 if line.startswith('{"gemma"'))
    assert gemma["drafter"] == "gemma4 assistant" and gemma["same_as_plain"] and gemma["mean_acceptance_length"] > 2
    accepted = sum(1 for tokens in panels.values() for _, _, d in tokens if d)
    assert accepted == record["num_accepted"] > 0
    bars = [v for v in values if 'class="mtp-stats"' in v and "data-rate" in v]
    rates = [f'data-rate="{r:.4f}"' for r in record["rates"]]
    assert any(all(r in b for r in rates) for b in bars)   # the view's final bars are LLM.stats'
    rich = [o["data"].get("text/html", "") for o in outputs if o.get("output_type") == "execute_result"]
    assert any('class="mtp-output"' in h for h in rich) and any('class="mtp-bar"' in h for h in rich)
    assert any('class="mtp-trace"' in h for h in rich) and any('class="mtp-shape-error"' in h for h in rich)


@pytest.mark.slow
def test_tp_notebook_runs_two_cpu_ranks():
    _, outputs = _execute("tp_notebook.ipynb")
    text = "".join(o.get("text", "") for o in outputs)
    assert "tensor_parallel_size 2" in text and "[True, True]" in text


def test_stop_click_reaches_a_running_cell():
    """A frontend's click (a comm message on the shell channel, as JupyterLab sends it) while
    the cell running watch() blocks the kernel: the requests stop early with "abort"."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", cwd=str(ROOT))
    try:
        kc.execute_interactive("from mtpkit import LLM, SamplingParams\nfrom mtpkit.notebook import watch\n"
                               "llm = LLM('tiny-qwen3-next', num_spec=3)\n"
                               "free = (llm.kv_pools.num_free, llm.slots.num_free)", timeout=120)
        run = kc.execute(f"outs = watch(llm, {PROMPTS!r}, SamplingParams(max_tokens=1900, ignore_eos=True))")
        button, redraws = None, 0
        while redraws < 3:   # the view is up and the text has been redrawn a few times
            msg = kc.get_iopub_msg(timeout=120)
            content = msg["content"]
            if msg["msg_type"] == "comm_open" and content["data"]["state"].get("_model_name") == "ButtonModel":
                button = content["comm_id"]
            elif msg["msg_type"] == "comm_msg" and "mtp-tok" in str(content["data"].get("state", {}).get("value")):
                redraws += 1
            assert msg["msg_type"] != "execute_result" and content.get("execution_state") != "idle"
        kc.shell_channel.send(kc.session.msg("comm_msg", {"comm_id": button, "data": {
            "method": "custom", "content": {"event": "click"}}}))
        while True:
            reply = kc.get_shell_msg(timeout=120)
            if reply["parent_header"].get("msg_id") == run:
                break
        assert reply["content"]["status"] == "ok"
        printed = []
        kc.execute_interactive("import json\nprint(json.dumps([[o.finish_reason, len(o.token_ids)] for o in outs]), "
                               "(llm.kv_pools.num_free, llm.slots.num_free) == free)",
                               output_hook=lambda m: printed.append(m["content"].get("text", "")), timeout=60)
        finished, pools_free = "".join(printed).rsplit(" ", 1)
        finished = json.loads(finished)
        assert [r for r, _ in finished] == ["abort"] * 3 and all(0 < n < 1900 for _, n in finished)
        assert pools_free.strip() == "True"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
