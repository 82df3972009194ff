"""Stop strings: matched in the decoded text across token boundaries, the stop string excluded
from the text and the tokens after it never emitted, in batches, inside an accepted MTP
bundle, and in streaming without ever showing text a later match takes back."""

import pytest

from mtpkit import LLM, SamplingParams
from mtpkit.text.detokenize import IncrementalDetokenizer
from mtpkit.engine.request import Status
from mtpkit.errors import InputError
from mtpkit.text.stop_strings import Appended, StopStringMatcher, cut_at_stop, partial_stop_len

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def push(self, x):"]
MAX = 40


class PieceTokenizer:
    """Token id i decodes to PIECES[i]: multi-character tokens."""
    PIECES = ["he", "llo", " wo", "rld", "!", " <|", "end", "|>"]

    def decode(self, ids):
        return "".join(self.PIECES[i] for i in ids)


def test_matcher_finds_the_token_that_completes_a_stop_across_tokens():
    tok = PieceTokenizer()
    m = StopStringMatcher(tok, ["lo wor"])
    assert m.find([0, 1], 2) is None              # "hello": "lo" may still become the stop
    assert m.find([0, 1, 2, 3, 4], 3) == 1        # " wo" "rld" "!": "rld" completes "lo wor"
    # a stop beginning in an earlier step's text is found by a later step
    m = StopStringMatcher(tok, ["<|end|>"])
    assert m.find([0, 1, 5], 1) is None
    assert m.find([0, 1, 5, 6], 1) is None
    assert m.find([0, 1, 5, 6, 7, 4], 2) == 0
    # tokens it saw in a step whose results were not kept (interrupted) are forgotten
    m = StopStringMatcher(tok, ["<|end|>"])
    assert m.find([0, 5, 6], 3) is None
    assert m.find([0, 1, 5, 6, 7], 4) == 3
    assert partial_stop_len("hello <|en", ["<|end|>", "xyz"]) == 4
    assert partial_stop_len("hello", ["<|end|>"]) == 0


def test_detokenizer_holds_back_a_possible_stop_and_cuts_at_it():
    d = IncrementalDetokenizer(PieceTokenizer(), stop=["<|end|>"])
    assert d.add([0, 1]) == "hello"
    assert d.add([5]) == " "                      # "<|" may begin the stop: held back
    assert d.add([6]) == ""
    assert d.add([7], final=True) == ""           # it did: never shown
    assert d.text == "hello "
    d = IncrementalDetokenizer(PieceTokenizer(), stop=["<|end|>"])
    assert d.add([0, 5]) == "he "
    assert d.add([4]) == "<|!"                    # it did not: released


@pytest.fixture(scope="module")
def engines():
    return {k: LLM("tiny-qwen3-next", num_spec=k, max_model_len=128) for k in (0, 3)}


def _events(llm, prompt):
    """Greedy reference run: the tokens of each stream event."""
    return [ev.new_token_ids for ev in llm.stream(prompt, SamplingParams(max_tokens=MAX, ignore_eos=True))]


def _choose_stop(llm, events, want):
    """(k, stop): a stop string of 3 characters that first occurs in the reference output
    exactly where token k ends, with token k placed in the stream events as `want(event,
    index in event)` asks."""
    tokens = [t for ev in events for t in ev]
    where = [(e, j) for e, ev in enumerate(events) for j in range(len(ev))]
    for k in range(4, len(tokens)):
        text = llm.tokenizer.decode(tokens[:k + 1])
        stop = text[-3:]
        if text.find(stop) == len(text) - 3 and len(llm.tokenizer.decode(tokens[k:k + 1])) < 3 \
                and want(events[where[k][0]], where[k][1]) and stop.strip():
            return k, stop, tokens
    raise AssertionError("no usable stop string in the reference output: the test cannot check anything")


def _assert_idle(llm):
    assert not llm.scheduler.running and not llm.scheduler.waiting
    assert (llm.kv_pools.num_free, llm.slots.num_free) == (llm.kv_pools.capacity, llm.slots.capacity)


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_stop_inside_an_accepted_mtp_bundle(engines, prompt):
    llm = engines[3]
    events = _events(llm, prompt)
    # token k is emitted by a verify step that accepted tokens after it
    k, stop, ref = _choose_stop(llm, events, lambda ev, j: len(ev) > 1 and j < len(ev) - 1)
    out = llm.generate(prompt, SamplingParams(max_tokens=MAX, stop=["never in the text", stop]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == ref[:k + 1]           # the bundle's tokens after the stop are dropped
    assert out.text == llm.tokenizer.decode(ref[:k + 1])[:-3]
    assert stop not in out.text
    _assert_idle(llm)


def test_stop_strings_in_a_batch_free_the_stopped_request(engines):
    llm = engines[3]
    refs = [[t for ev in _events(llm, p) for t in ev] for p in PROMPTS]
    k, stop, _ = _choose_stop(llm, _events(llm, PROMPTS[0]), lambda ev, j: True)
    reqs = [llm.add_request(PROMPTS[0], SamplingParams(max_tokens=MAX, stop=[stop])),
            llm.add_request(PROMPTS[1], SamplingParams(max_tokens=MAX, stop=["\x00never"], ignore_eos=True)),
            llm.add_request(PROMPTS[2], SamplingParams(max_tokens=MAX, ignore_eos=True))]
    while reqs[0].status != Status.FINISHED:
        llm.step()
    # the stopped request's KV blocks and state slots are back while the others keep running
    assert reqs[0].finish_reason == "stop" and not reqs[0].block_tables and reqs[0].state_slots is None
    running = llm.scheduler.running
    assert running and reqs[0] not in running
    held = sum(len(r.block_tables[0].held()) for r in running)
    assert llm.kv_pools.num_free["full"] == llm.kv_pools.capacity["full"] - held
    while llm.scheduler.has_unfinished():
        llm.step()
    assert reqs[0].output_token_ids == refs[0][:k + 1]
    assert [r.output_token_ids for r in reqs[1:]] == refs[1:]
    assert [r.finish_reason for r in reqs[1:]] == ["length", "length"]
    _assert_idle(llm)


@pytest.mark.parametrize("num_spec", [0, 3])
def test_streaming_never_emits_text_a_stop_takes_back(engines, num_spec):
    llm = engines[num_spec]
    prompt = PROMPTS[2]
    events = _events(llm, prompt)
    # the stop begins in an earlier event than the one that completes it
    k, stop, ref = _choose_stop(llm, events, lambda ev, j: j < 2)
    final = llm.tokenizer.decode(ref[:k + 1])[:-3]
    shown, deltas, last = [], [], None
    for ev in llm.stream(prompt, SamplingParams(max_tokens=MAX, stop=[stop])):
        shown.append(ev.text)
        deltas.append(ev.delta)
        last = ev
    assert last.finished and last.output.finish_reason == "stop" and last.output.text == final
    assert len(shown) > 1
    for text in shown:
        assert final.startswith(text), f"streamed {text!r}, which the stop {stop!r} later retracts"
    assert "".join(deltas) == final
    _assert_idle(llm)


def test_bad_stop_values_are_refused(engines):
    llm = engines[0]
    for bad in ([""], [1], ["a", None]):
        with pytest.raises(InputError, match="stop="):
            llm.generate("x", SamplingParams(stop=bad))
    # one string is one stop string
    assert llm.generate("x = 1", SamplingParams(max_tokens=4, stop="\x00never"))[0].finish_reason == "length"


def test_cli_stop(engines, capsys):
    from mtpkit import cli
    prompt = PROMPTS[0]
    text = engines[3].generate(prompt, SamplingParams(max_tokens=MAX))[0].text
    i = next(i for i in range(4, len(text) - 3) if text.find(text[i:i + 3]) == i and text[i:i + 3].strip())
    assert cli.main(["generate", prompt, "--max-tokens", str(MAX), "--stop", "\x00never", "--stop",
                     text[i:i + 3]]) == 0
    out = capsys.readouterr().out
    assert out.startswith(text[:i]) and text[:i + 3] not in out and "finish_reason=stop" in out, out


def _first_completing(tokenizer, ids, stops):
    """By definition: the first k such that decoding ids[:k + 1] whole contains a stop."""
    return next((k for k in range(len(ids)) if any(s in tokenizer.decode(ids[:k + 1]) for s in stops)), None)


def test_incremental_matcher_equals_whole_decoding(engines):
    """Random outputs mixing ASCII and characters split over byte tokens, cut into random
    steps: the matcher's answer is the definition's."""
    import random
    tok = engines[0].tokenizer
    rng = random.Random(0)
    words = ["ab", "中文", "é", "x=1", " ", "\n", "ü", "🙂", "stop", "<|", "end", "|>"]
    for _ in range(60):
        text = "".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
        ids = tok.encode(text).ids
        stops = rng.sample(["中", "文é", "<|end|>", "a 🙂", "1\n", "zz", "b中", "op\n"], k=2)
        want = _first_completing(tok, ids, stops)
        m, got, pos = StopStringMatcher(tok, stops), None, 0
        while pos < len(ids) and got is None:
            n = rng.randint(1, 4)
            j = m.find(ids[:pos + n], len(ids[pos:pos + n]))
            got = None if j is None else pos + j
            pos += n
        assert got == want, (text, stops)


def test_appended_slices_as_the_concatenation():
    a, b = list(range(10)), [100, 101, 102]
    joined = Appended(a, b)
    assert len(joined) == 13
    for i in range(14):
        for j in range(i, 14):
            assert joined[i:j] == (a + b)[i:j], (i, j)
    assert joined[-4:] == (a + b)[-4:]
    tok = PieceTokenizer()   # the matcher reads it as it reads the list
    m1, m2 = StopStringMatcher(tok, ["<|end|>"]), StopStringMatcher(tok, ["<|end|>"])
    steps = [[0, 1], [5], [6, 7], [4]]
    out = []
    for new in steps:
        assert m1.find(Appended(out, new), len(new)) == m2.find(out + new, len(new))
        out += new


class _SpyList(list):
    """A request's output list that records every concatenation of it (its length)."""
    added: list = []

    def __add__(self, other):
        _SpyList.added.append(len(self))
        return list.__add__(self, other)


def test_a_step_with_stop_strings_does_not_copy_the_whole_output(monkeypatch):
    """The stop-string check reads the output's tail (Appended), not output + new tokens, which
    made every step's host work grow with the output."""
    from mtpkit.engine.request import Request
    post = Request.__post_init__

    def spied(self):
        post(self)
        self.output_token_ids = _SpyList(self.output_token_ids)
    monkeypatch.setattr(Request, "__post_init__", spied)
    _SpyList.added = []
    llm = LLM("tiny-qwen3-next", num_spec=2, max_model_len=128)
    out = llm.generate(["def f(x):"], SamplingParams(max_tokens=40, ignore_eos=True, stop=["<|never|>"]))[0]
    assert len(out.token_ids) == 40 and out.finish_reason == "length"
    assert not _SpyList.added, _SpyList.added


def test_stream_events_output_is_the_output_as_of_the_event_read_late(engines, monkeypatch):
    """A stream event's `output` is built when first read (building one per event copies every
    token list, quadratic in the output over a stream), yet it is the output as of that event:
    read after the stream ended, each event's output holds exactly the tokens, text, steps, draft
    positions and logprobs up to it, unfinished but the last. generate() builds one per prompt."""
    import mtpkit.llm as llm_module
    llm = engines[3]
    prompts = [llm.tokenizer.encode(t).ids for t in ("def fibonacci(n):", "The capital of")]
    sps = [SamplingParams(max_tokens=20, ignore_eos=True, logprobs=1),
           SamplingParams(max_tokens=14, ignore_eos=True, temperature=0.8, seed=3, stop=["\n\n\n"])]
    events = list(llm.stream(prompts, sps))          # no output read while streaming
    for i in range(2):
        mine = [ev for ev in events if ev.index == i]
        tokens = []
        for j, ev in enumerate(mine):
            tokens += ev.new_token_ids
            out = ev.output
            assert out.token_ids == tokens
            assert len(out.token_steps) == len(tokens)
            assert len(out.token_draft_positions) == len(tokens)
            assert out.finished == (j == len(mine) - 1)
            assert out.text == cut_at_stop(llm.tokenizer.decode(tokens), sps[i].stop or [])
            if sps[i].logprobs is not None:
                assert len(out.logprobs) == len(tokens)
    built = []
    real = llm_module._PromptState.build
    monkeypatch.setattr(llm_module._PromptState, "build", lambda self: built.append(1) or real(self))
    outs = llm.generate(prompts, sps)
    assert len(built) == len(prompts) and [o.token_ids for o in outs] == [
        [t for ev in events if ev.index == i for t in ev.new_token_ids] for i in range(2)]
