"""The user-facing edges: named errors for bad devices and tokenizer files, incremental
detokenization of streamed text, the command line (help, validation, Ctrl-C, python -m mtpkit),
examples/serve_batch.py's input checks, and the CPU path never importing Triton.

Everything here runs on the embedded tiny model or on no model at all (< 60 s in all)."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mtpkit
import mtpkit.checkpoint.loader as loader_mod
from mtpkit import LLM, CheckpointError, ConfigError, SamplingParams
from mtpkit.checkpoint.hub import resolve_model

ROOT = Path(__file__).resolve().parent.parent
TINY = resolve_model("tiny-qwen3-next")


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture
def no_weights(monkeypatch):
    """Fail if the weights are loaded."""
    def fail(*a, **k):
        raise AssertionError("the weights were loaded before the error was raised")
    monkeypatch.setattr(loader_mod, "load_checkpoint", fail)


@pytest.fixture
def tiny_copy(tmp_path):
    dst = tmp_path / "tiny"
    shutil.copytree(TINY, dst)
    return dst


# ---------------------------------------------------------------------------------------------
# named errors: device, tokenizer.json
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["tpu", "mps", "cpu:x"])
def test_unsupported_device_is_a_config_error(device, no_weights):
    with pytest.raises(ConfigError) as ei:
        LLM("tiny-qwen3-next", device=device)
    msg = str(ei.value)
    assert repr(device) in msg and "'cpu'" in msg and "'cuda'" in msg, msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda")])
def test_cuda_without_a_gpu_is_a_config_error(device, no_weights):
    with pytest.raises(ConfigError) as ei:
        LLM("tiny-qwen3-next", device=device)
    msg = str(ei.value)
    assert "no CUDA device" in msg and "device='cpu'" in msg and "Triton" not in msg, msg


def test_resolve_device():
    from mtpkit.config import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    assert resolve_device(None) == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ConfigError):
        resolve_device(3.5)


@pytest.mark.parametrize("content", ['{"version": "1.0", ', "", '{"model": {"type": "Nope"}}'])
def test_corrupt_tokenizer_json_named_before_the_weights_load(tiny_copy, content, no_weights):
    f = tiny_copy / "tokenizer.json"
    f.write_text(content)
    with pytest.raises(CheckpointError) as ei:
        LLM(tiny_copy)
    assert str(f) in str(ei.value), str(ei.value)


def test_tokenizer_larger_than_the_model_vocab(tiny_copy, no_weights):
    cfg = json.loads((tiny_copy / "config.json").read_text())
    cfg["vocab_size"] = 200
    cfg["eos_token_id"] = 0   # inside the smaller vocabulary: the tokenizer is what does not fit
    (tiny_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as ei:
        LLM(tiny_copy)
    msg = str(ei.value)
    assert "tokenizer.json" in msg and "200" in msg and "257" in msg, msg


# ---------------------------------------------------------------------------------------------
# incremental detokenization
# ---------------------------------------------------------------------------------------------

# The embedded tokenizer is byte-level with ids equal to byte values (256 is <|endoftext|>):
# "中文" is E4 B8 AD E6 96 87, one token per byte, so each character spans three tokens.
CJK = "中文"
CJK_IDS = list(CJK.encode("utf-8"))


def test_tokenizer_splits_the_characters_into_byte_tokens():
    llm_tok = mtpkit.text.tokenizer.load_tokenizer(TINY)
    assert llm_tok.encode(CJK).ids == CJK_IDS
    assert llm_tok.decode(CJK_IDS[:1]) == "\ufffd"  # what naive streaming prints


def test_detokenizer_holds_back_incomplete_characters():
    from mtpkit.text.detokenize import IncrementalDetokenizer

    tok = mtpkit.text.tokenizer.load_tokenizer(TINY)
    d = IncrementalDetokenizer(tok)
    deltas = [d.add([t]) for t in CJK_IDS]
    assert deltas == ["", "", "中", "", "", "文"]
    assert d.text == CJK
    # a held-back byte is released as the decoder has it when the sequence ends there
    d2 = IncrementalDetokenizer(tok)
    assert d2.add(list(b"ab") + CJK_IDS[:2]) == "ab"
    assert d2.add([], final=True) == "\ufffd" and d2.text == tok.decode(list(b"ab") + CJK_IDS[:2])
    # several tokens at once, ASCII after the split character, and a tokenizer-less checkpoint
    d3 = IncrementalDetokenizer(tok)
    assert [d3.add(CJK_IDS[:4]), d3.add(CJK_IDS[4:] + list(b"!"))] == ["中", "文!"]
    assert IncrementalDetokenizer(None).add([1, 2], final=True) == ""


@pytest.fixture
def scripted_logits(monkeypatch):
    """The model's next token follows a script (one-hot logits per compute_logits call; with
    num_spec=0 every call samples one token per request): the engine, sampler, scheduler and
    stream run for real on chosen token ids."""
    from mtpkit.models.qwen3_next.model import Qwen3NextForCausalLM

    def install(tokens):
        it = iter(tokens)

        def compute_logits(self, hidden):
            logits = torch.full((hidden.shape[0], self.cfg.vocab_size), -1e4, dtype=hidden.dtype,
                                device=hidden.device)
            logits[:, next(it)] = 0.0
            return logits

        monkeypatch.setattr(Qwen3NextForCausalLM, "compute_logits", compute_logits)

    return install


def test_stream_deltas_never_split_a_character(scripted_logits):
    script = list(b"x=") + CJK_IDS + list(b"\n")
    scripted_logits(script)
    llm = LLM("tiny-qwen3-next", enforce_eager=True)
    events = list(llm.stream([list(b"s = ")], SamplingParams(max_tokens=len(script), ignore_eos=True)))
    assert [t for ev in events for t in ev.new_token_ids] == script
    final = events[-1]
    assert final.finished and final.output.text == "x=中文\n" == final.text
    assert "".join(ev.delta for ev in events) == final.text
    assert not any("\ufffd" in ev.delta or "\ufffd" in ev.text for ev in events)
    for ev in events:  # text is always the concatenation of the deltas so far
        assert final.text.startswith(ev.text)


def test_cli_prints_split_characters_whole(scripted_logits, capsys):
    from mtpkit import cli

    scripted_logits(CJK_IDS + list(b"ok"))
    assert cli.main(["generate", "s = ", "--num-spec", "0", "--max-tokens", str(len(CJK_IDS) + 2)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(CJK + "ok") and "\ufffd" not in out, out


# ---------------------------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------------------------


def _run_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "mtpkit", *args], capture_output=True, text=True,
                          cwd=ROOT, env=_env(), timeout=timeout)


def test_python_dash_m_mtpkit_and_generate_help():
    r = _run_cli("generate", "--help")
    assert r.returncode == 0, r.stderr
    out = " ".join(r.stdout.split())  # argparse wraps lines
    for opt, default in [("--model", "tiny-qwen3-next"), ("--num-spec", "3"), ("--max-tokens", "128"),
                         ("--temperature", "0.0"), ("--top-k", "0"), ("--top-p", "1.0"),
                         ("--seed", "None"), ("--dtype", "auto"), ("--max-num-seqs", "8")]:
        assert opt in out and f"(default: {default})" in out, (opt, default, r.stdout)
    # every option has a help text: no option line stands alone
    lines = r.stdout.splitlines()
    for i, ln in enumerate(lines):
        s = ln.strip()
        if s.startswith("--") and s.split()[-1].isupper() and len(s.split()) <= 2:
            assert lines[i + 1].startswith(" " * 8), f"{s} has no help text"
    assert r.returncode == 0 and "usage: mtpkit" in _run_cli("--help").stdout


@pytest.mark.parametrize("seed", ["99999999999999999999", "-1", "abc"])
def test_cli_rejects_a_bad_seed_before_loading(seed, capsys, no_weights):
    from mtpkit import cli

    with pytest.raises(SystemExit) as ei:
        cli.main(["generate", "x", "--seed", seed])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert "--seed" in err and "0 and 2**64-1" in err and "Traceback" not in err, err


def test_sampling_params_reject_a_seed_torch_cannot_take():
    from mtpkit import InputError

    llm = LLM("tiny-qwen3-next", enforce_eager=True)
    for seed in (2**64, -1):
        with pytest.raises(InputError, match="seed"):
            llm.generate("x", SamplingParams(max_tokens=2, temperature=0.5, seed=seed))
    assert len(llm.generate("x", SamplingParams(max_tokens=2, temperature=0.5, seed=2**64 - 1))[0].token_ids) == 2


@pytest.mark.parametrize("flag,value,words", [
    ("--gpu-memory-utilization", "1.5", "not a number in (0, 1]"),
    ("--gpu-memory-utilization", "0", "not a number in (0, 1]"),
    ("--gpu-memory-utilization", "most", "not a number in (0, 1]"),
    ("--memory-budget", "-5", "not a positive byte count"),
    ("--memory-budget", "12XB", "not a positive byte count"),
    ("--kv-cache-memory", "0", "not a positive byte count"),
    ("--num-blocks", "1", "not an int >= 2"),
    ("--fp8-weights", "yes", "invalid choice"),
])
def test_cli_rejects_bad_memory_options_before_loading(flag, value, words, capsys, no_weights):
    from mtpkit import cli

    with pytest.raises(SystemExit) as ei:
        cli.main(["generate", "x", flag, value])
    err = capsys.readouterr().err
    assert ei.value.code == 2 and flag in err and words in err and "Traceback" not in err, err


def test_cli_byte_counts():
    from mtpkit.cli import byte_count

    assert byte_count("4096") == 4096 and byte_count("64MiB") == 64 << 20 and byte_count("1.5GB") == 1_500_000_000
    assert byte_count("8gib") == 8 << 30


def test_cli_memory_options_reach_the_engine(capsys, monkeypatch):
    """A budget sizes the pools (the plan on stderr); the engine's own refusals (a budget and an
    explicit size together, a GPU share on CPU) are the CLI's error before any weight loads."""
    from mtpkit import cli

    argv = ["generate", "def f(x):", "--num-spec", "2", "--max-tokens", "3", "--max-model-len", "256"]
    assert cli.main(argv + ["--memory-budget", "96MiB"]) == 0
    err = capsys.readouterr().err
    assert "mtpkit memory plan: budget 96.0 MiB" in err and "max_model_len=256" in err, err
    monkeypatch.setattr(loader_mod, "load_checkpoint", lambda *a, **k: pytest.fail("weights loaded"))
    assert cli.main(argv + ["--memory-budget", "96MiB", "--num-blocks", "100"]) == 2
    assert "num_blocks=100 and a memory budget both size the caches" in capsys.readouterr().err
    assert cli.main(argv + ["--gpu-memory-utilization", "0.8"]) == 2
    assert "gpu_memory_utilization needs a CUDA device" in capsys.readouterr().err


def test_cli_fp8_weights_choose_kept_or_dequantized(tmp_path, monkeypatch, capsys):
    from mtpkit import cli
    from test_fp8 import make_fp8

    make_fp8(TINY, tmp_path / "fp8", tmp_path / "twin", (128, 128))
    built = []

    class Recording(LLM):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            built.append(sum(p.numel() for p in self.model.parameters() if p.dtype == torch.float8_e4m3fn))

    monkeypatch.setattr(mtpkit, "LLM", Recording)
    argv = ["generate", "x", "--model", str(tmp_path / "fp8"), "--num-spec", "1", "--max-tokens", "2",
            "--max-model-len", "64"]
    for choice in ("keep", "dequantize", "auto"):   # auto on CPU: dequantized
        assert cli.main(argv + ["--fp8-weights", choice]) == 0, capsys.readouterr().err
    assert built[0] > 0 and built[1] == built[2] == 0


@pytest.mark.parametrize("no_stream", [False, True])
def test_ctrl_c_prints_a_note_and_the_text_and_exits_130(monkeypatch, capsys, no_stream):
    from mtpkit import cli

    llm = LLM("tiny-qwen3-next")   # the CLI applies the checkpoint's penalties (generation_config.json)
    want = llm.generate("def f(x):", dataclasses.replace(llm.generation_defaults.sampling_params(), max_tokens=3))[0].text
    real = LLM.stream

    def interrupted(self, *a, **k):  # Ctrl-C after the third step
        for i, ev in enumerate(real(self, *a, **k)):
            yield ev
            if i == 2:
                raise KeyboardInterrupt

    monkeypatch.setattr(LLM, "stream", interrupted)
    argv = ["generate", "def f(x):", "--num-spec", "0", "--max-tokens", "20"] + (["--no-stream"] if no_stream else [])
    assert cli.main(argv) == 130
    cap = capsys.readouterr()
    assert cap.out.startswith(want), (cap.out, want)
    note = [ln for ln in cap.err.splitlines() if ln.strip()]
    assert len(note) == 1 and "interrupted" in note[0] and "3 tokens" in note[0], cap.err
    assert "Traceback" not in cap.err + cap.out


# ---------------------------------------------------------------------------------------------
# examples/serve_batch.py: every input check before the model loads
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def serve_batch(monkeypatch):
    """The example script as a module, with LLM replaced by a tripwire (checks must come first)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("serve_batch", ROOT / "examples" / "serve_batch.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(mod, "LLM", no_model)
    return mod


def _serve(mod, capsys, *args):
    rc = mod.main(["--num-spec", "0", "--max-tokens", "4", *map(str, args)])
    return rc, capsys.readouterr().err


def test_serve_batch_missing_input_before_the_model(serve_batch, capsys, tmp_path):
    rc, err = _serve(serve_batch, capsys, "--prompts", tmp_path / "nope.jsonl", "--output", tmp_path / "o.jsonl")
    assert rc == 2 and "nope.jsonl" in err and "no such file" in err, err


def test_serve_batch_output_directory_checked_before_the_model(serve_batch, capsys, tmp_path):
    out = tmp_path / "missing-dir" / "out.jsonl"
    rc, err = _serve(serve_batch, capsys, "--prompts", ROOT / "examples" / "prompts.jsonl", "--output", out)
    assert rc == 2 and "missing-dir" in err and "does not exist" in err, err
    rc, err = _serve(serve_batch, capsys, "--prompts", ROOT / "examples" / "prompts.jsonl", "--output", tmp_path)
    assert rc == 2 and "is a directory" in err, err


def test_serve_batch_every_bad_line_named_before_the_model(serve_batch, capsys, tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_text('{"prompt": "ok"}\n{"prompt": "broken"\n{"prompt": 123}\n\n{"prompt_token_ids": "abc"}\n'
                 '{"prompt_token_ids": [1, true]}\n{"prompt_token_ids": [5, 999]}\n["x"]\n{"prompt": ""}\n')
    rc, err = _serve(serve_batch, capsys, "--prompts", f, "--output", tmp_path / "o.jsonl")
    assert rc == 2 and not (tmp_path / "o.jsonl").exists()
    for n, words in [(2, "not valid JSON"), (3, '"prompt" must be a str'), (5, "must be a list of ints"),
                     (6, "must be a list of ints"), (7, "[999] are outside the vocabulary"),
                     (8, "expected an object"), (9, "is empty")]:
        line = [ln for ln in err.splitlines() if f"{f}:{n}:" in ln]
        assert line and words in line[0], (n, words, err)
    assert f"{f}:1:" not in err and f"{f}:4:" not in err and "7 bad input line(s)" in err


def test_serve_batch_keep_going_writes_error_records(capsys, tmp_path):
    """With --keep-going the good lines run (the real model) and the bad ones become records."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("serve_batch", ROOT / "examples" / "serve_batch.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    f, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    f.write_text('{"prompt": "def f(x):"}\n{"prompt": 123}\n{"prompt_token_ids": "abc"}\n'
                 '{"prompt_token_ids": [100, 101, 102]}\n')
    rc = mod.main(["--prompts", str(f), "--output", str(out), "--num-spec", "2", "--max-tokens", "4",
                   "--ignore-eos", "--keep-going"])
    assert rc == 0, capsys.readouterr().err
    rows = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2, 3]
    assert [len(r["token_ids"]) for r in rows] == [4, 0, 0, 4]
    assert f"{f}:2:" in rows[1]["error"] and f"{f}:3:" in rows[2]["error"]
    assert "error" not in rows[0] and "error" not in rows[3] and rows[0]["text"]
    assert "2/4 requests" in capsys.readouterr().out


def test_serve_batch_memory_options(capsys, tmp_path):
    """serve_batch takes the CLI's memory options: checked by argparse, then passed to LLM (a
    budget's plan on stderr)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("serve_batch", ROOT / "examples" / "serve_batch.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with pytest.raises(SystemExit):
        mod.main(["--gpu-memory-utilization", "2"])
    assert "not a number in (0, 1]" in capsys.readouterr().err
    out = tmp_path / "out.jsonl"
    rc = mod.main(["--output", str(out), "--num-spec", "2", "--max-tokens", "3", "--max-model-len", "256",
                   "--memory-budget", "96MiB", "--ignore-eos", "--cpu"])
    err = capsys.readouterr().err
    assert rc == 0 and "mtpkit memory plan: budget 96.0 MiB" in err, err
    assert all(len(json.loads(ln)["token_ids"]) == 3 for ln in out.read_text().splitlines())


def test_the_shipped_example_prompts_are_valid(serve_batch):
    prompts, lines = serve_batch.read_prompts(str(ROOT / "examples" / "prompts.jsonl"), True, 257)
    assert lines == sorted(lines) and len(lines) == len(prompts)
    assert len(prompts) >= 3 and not any(isinstance(p, serve_batch.BadLine) for p in prompts)


# ---------------------------------------------------------------------------------------------
# install: Triton only for GPUs (and the kernel tests)
# ---------------------------------------------------------------------------------------------


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=_env(),
                          timeout=120)


def test_cpu_path_never_imports_triton():
    r = _python("import sys, mtpkit\n"
                "out = mtpkit.LLM('tiny-qwen3-next', num_spec=2).generate('x')\n"
                "assert out[0].token_ids\n"
                "print('triton' in sys.modules, [m for m in sys.modules if m.split('.')[0] == 'triton'\n"
                "       or m.startswith('mtpkit.kernels.triton')])")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False []", r.stdout


def test_triton_backend_without_triton_says_what_to_install():
    # sys.modules["triton"] = None: `import triton` raises ModuleNotFoundError, as when not installed
    r = _python("import sys; sys.modules['triton'] = None\n"
                "import torch, mtpkit\n"
                "from mtpkit.kernels.ops import select_ops\n"
                "try:\n"
                "    select_ops(torch.device('cpu'), 'triton')\n"
                "except mtpkit.ConfigError as e:\n"
                "    print('ConfigError:', e)\n")
    assert r.returncode == 0, r.stderr
    assert "ConfigError:" in r.stdout and 'pip install "mtpkit[gpu]"' in r.stdout, r.stdout


def test_triton_is_an_extra_not_a_core_dependency():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = lambda reqs: {r.split(">")[0].split("=")[0].split("<")[0].split("[")[0].strip() for r in reqs}  # noqa: E731
    assert "triton" not in names(project["dependencies"])
    extras = project["optional-dependencies"]
    assert {"triton", "fla-core"} <= names(extras["gpu"])
    assert "triton" in names(extras["test"]) and "nbconvert" in names(extras["test"])
    for extra in ("cuda", "fla"):  # every GPU extra brings Triton with it
        assert "triton" in names(extras[extra])
