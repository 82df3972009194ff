"""The llama.cpp driver (benchmarks/llamacpp/driver.cpp) as a long-lived subprocess: the model
loads once, then every `generate` writes one request line of token ids to its stdin and reads
one JSON line back, so a benchmark times decoding, not loading.

    with LlamaCppDriver(driver_path(workdir), *model_files(workdir, "tiny-gemma4"), mode="mtp") as d:
        d.generate(prompt_ids, 64).tokens

Used by benchmarks/llamacpp/build.py (the correctness check), benchmarks/bench_cpu.py (the
baseline rows) and tests/test_llamacpp_driver.py.
"""

import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

BUILD_COMMAND = "python benchmarks/llamacpp/build.py"
DRIVER_NAME = "mtpkit-llamacpp-driver"
DEFAULT_WORKDIR = Path.home() / ".cache" / "mtpkit-llamacpp"
DRAFTERS = {"tiny-gemma4": "tiny-gemma4-assistant"}   # the others draft with their own MTP head
NUM_DRAFTS = 3   # llama.cpp's draft length in MTP mode (the reference table's)


def workdir_from_env() -> Path:
    return Path(os.environ.get("MTPKIT_LLAMACPP", DEFAULT_WORKDIR)).expanduser()


def driver_path(workdir: Path) -> Path:
    return Path(workdir) / "build" / DRIVER_NAME


def model_files(workdir: Path, name: str) -> tuple[Path, Path | None]:
    """The target's GGUF and, where it drafts with a separate model, the drafter's."""
    models = Path(workdir) / "models"
    drafter = DRAFTERS.get(name)
    return models / f"{name}.gguf", (models / f"{drafter}.gguf" if drafter else None)


def missing(workdir: Path, name: str) -> str | None:
    """Why llama.cpp cannot run `name` from `workdir` (and how to fix it), or None if it can."""
    files = [driver_path(workdir), *(p for p in model_files(workdir, name) if p is not None)]
    absent = [str(p) for p in files if not p.is_file()]
    if absent:
        build = BUILD_COMMAND + ("" if Path(workdir) == DEFAULT_WORKDIR else f" --workdir {workdir}")
        return f"llama.cpp is not built ({', '.join(absent)} missing): run `{build}`"
    return None


@dataclass
class Generation:
    tokens: list[int]
    prefill_s: float
    decode_s: float
    total_s: float
    n_drafted: int
    n_accepted: int
    n_steps: int


class LlamaCppDriver:
    """One driver process: greedy, one thread unless told otherwise, `mode` "plain" or "mtp".
    `ctx` bounds prompt + max_tokens of a request (the driver exits with llama.cpp's error past it)."""

    def __init__(self, driver: Path, model: Path, drafter: Path | None = None, mode: str = "plain",
                 threads: int = 1, num_drafts: int = NUM_DRAFTS, ctx: int = 1024):
        if mode not in ("plain", "mtp"):
            raise ValueError(f"mode must be 'plain' or 'mtp', not {mode!r}")
        cmd = [str(driver), "-m", str(model), "-t", str(threads), "-tb", str(threads), "-c", str(ctx),
               "-b", str(ctx), "-ub", str(ctx)]
        if mode == "mtp":
            cmd += ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(num_drafts),
                    "--spec-draft-n-min", "0"]
            if drafter is not None:
                cmd += ["-md", str(drafter), "-td", str(threads), "-tbd", str(threads)]
        self.mode = mode
        self.log = tempfile.TemporaryFile(mode="w+")   # llama.cpp logs to stderr: never a full pipe
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, bufsize=1)
        ready = self._read()
        if not ready.get("ready"):
            raise RuntimeError(f"the llama.cpp driver did not start: {ready}")

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=30)
            self.log.seek(0)
            tail = self.log.read()[-3000:]
            raise RuntimeError(f"the llama.cpp driver exited ({self.proc.returncode}):\n{tail}")
        return json.loads(line)

    def generate(self, prompt: list[int], max_tokens: int) -> Generation:
        self.proc.stdin.write(f"{max_tokens} {' '.join(map(str, prompt))}\n")
        self.proc.stdin.flush()
        return Generation(**self._read())

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def mtpkit_greedy(name: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """mtpkit's greedy output, no drafts, float32: what llama.cpp's must equal."""
    from mtpkit import LLM, SamplingParams

    llm = LLM(name, dtype="float32")
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        return [o.token_ids for o in outs]
    finally:
        llm.close()
