"""Builds llama.cpp (CPU only) as the benchmark's baseline, converts the embedded models to GGUF
and checks that llama.cpp's greedy output equals mtpkit's, token for token.

    python benchmarks/llamacpp/build.py                   # into ~/.cache/mtpkit-llamacpp
    python benchmarks/llamacpp/build.py --workdir DIR --jobs 2

Steps (each skipped when its output is already there; the build is incremental; `--force`
reconverts the models):
1. `pip download --no-binary :all: llama-cpp-python==0.3.36` into WORKDIR and extract it: the
   sdist vendors llama.cpp (commit 0c1e57098), whose tree is built, never the Python package.
2. Two small source edits the tiny embedded models need (`patch_sources`; the real models
   need neither): the gated-delta-net q rescale for zero-padded key heads (qwen3next), and the
   Gemma 4 assistant's hidden-size check (it refuses an assistant as wide as its target).
3. CMake, Release, CPU only (GGML_NATIVE, OpenMP), of libllama + common + the driver
   (`benchmarks/llamacpp/driver.cpp`, `benchmarks/llamacpp/CMakeLists.txt`, copied to
   WORKDIR/driver-src): ~15-30 min on 2 cores the first time.
4. `benchmarks/llamacpp/convert.py`: f32 GGUFs of tiny-qwen3-next (with its MTP head),
   tiny-gemma4 and tiny-gemma4-assistant in WORKDIR/models.
5. The correctness check: the driver's greedy output (plain, and MTP) equals
   `LLM(name).generate` on the 8 held-out prompts of benchmarks/bench_cpu.py, 64 tokens each.
   It exits non-zero, naming the first prompt and position that differ, when not.

Nothing here is committed to the repo: sources, build and models live in WORKDIR.
"""

import argparse
import os
import subprocess
import sys
import tarfile
from pathlib import Path

VERSION = "0.3.36"  # llama-cpp-python; vendors llama.cpp 0c1e57098
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from llamacpp_client import (DEFAULT_WORKDIR, DRIVER_NAME, LlamaCppDriver, driver_path,  # noqa: E402
                             model_files, mtpkit_greedy)


def llama_cpp_dir(workdir: Path) -> Path:
    return workdir / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"


def fetch_sources(workdir: Path) -> Path:
    src = llama_cpp_dir(workdir)
    if (src / "CMakeLists.txt").is_file():
        return src
    workdir.mkdir(parents=True, exist_ok=True)
    sdist = workdir / f"llama_cpp_python-{VERSION}.tar.gz"
    if not sdist.is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "-d", str(workdir), f"llama-cpp-python=={VERSION}"],
                       check=True)
    with tarfile.open(sdist) as tar:
        tar.extractall(workdir, filter="data")
    return src


# (file, the text as shipped, the text after the edit). Each edit is checked to apply exactly once.
EDITS = [
    # tiny-qwen3-next has GDN key heads of 32 and value heads of 64; llama.cpp's delta-net op
    # wants S_k == S_v, so convert.py zero-pads each q/k head to 64 (exact for the dot
    # products) and records the original size. The op scales q by 1/sqrt(S_k) = 1/sqrt(64);
    # the checkpoint was trained with 1/sqrt(32): multiply q by sqrt(64/32) after its L2 norm.
    ("src/models/qwen3next.cpp",
     ("    q_conv = build_gdn_l2_norm(ctx0, q_conv, eps_norm);\n"
      "    k_conv = build_gdn_l2_norm(ctx0, k_conv, eps_norm);\n"),
     ("    q_conv = build_gdn_l2_norm(ctx0, q_conv, eps_norm);\n"
      "    k_conv = build_gdn_l2_norm(ctx0, k_conv, eps_norm);\n"
      "    {   // mtpkit: q/k heads zero-padded from mtpkit.ssm_key_head_dim to head_k_dim\n"
      "        const auto it = model.gguf_kv.find(\"mtpkit.ssm_key_head_dim\");\n"
      "        if (it != model.gguf_kv.end()) {\n"
      "            q_conv = ggml_scale(ctx0, q_conv, sqrtf((float) head_k_dim / std::stof(it->second)));\n"
      "        }\n"
      "    }\n")),
    # tiny-gemma4-assistant is as wide as its target (256 = 256): the check that
    # embedding_length_out carries a different (the target's) width does not hold, and the
    # width it reads is right all the same.
    ("src/models/gemma4-assistant.cpp",
     "    if (hparams.n_embd_out() == n_embd) {\n",
     "    if (false && hparams.n_embd_out() == n_embd) {  // mtpkit: equal widths are fine\n"),
]


def patch_sources(src: Path) -> None:
    for rel, before, after in EDITS:
        path = src / rel
        text = path.read_text()
        if after in text:
            continue
        if text.count(before) != 1:
            raise SystemExit(f"{path}: the text to edit is not there exactly once; is this llama.cpp "
                             f"the one llama-cpp-python {VERSION} vendors?")
        path.write_text(text.replace(before, after))


def driver_sources(workdir: Path) -> Path:
    """The driver's CMake project, copied into the workdir: the build then does not depend on
    where this checkout lives (a build dir remembers its source dir). Files are rewritten only
    when they changed, so an unchanged driver is not rebuilt."""
    dst = workdir / "driver-src"
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("CMakeLists.txt", "driver.cpp"):
        text = (HERE / name).read_text()
        if not (dst / name).is_file() or (dst / name).read_text() != text:
            (dst / name).write_text(text)
    return dst


def build(workdir: Path, src: Path, jobs: int) -> Path:
    build_dir = workdir / "build"
    nice = ["nice", "-n", "19"] if os.name == "posix" else []
    subprocess.run(nice + ["cmake", "-S", str(driver_sources(workdir)), "-B", str(build_dir), f"-DLLAMA_CPP_DIR={src}",
                           "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DGGML_OPENMP=ON",
                           "-DBUILD_SHARED_LIBS=OFF"], check=True)
    subprocess.run(nice + ["cmake", "--build", str(build_dir), "-j", str(jobs),
                           "--target", DRIVER_NAME], check=True)
    return driver_path(workdir)


def check(workdir: Path, max_tokens: int = 64) -> None:
    """llama.cpp's greedy tokens equal mtpkit's on the held-out prompts, plain and MTP."""
    sys.path.insert(0, str(HERE.parent))
    from bench_cpu import heldout_prompts  # noqa: E402

    prompts = heldout_prompts(8, 64)
    failed = []
    for name in ("tiny-qwen3-next", "tiny-gemma4"):
        want = mtpkit_greedy(name, prompts, max_tokens)
        for mode in ("plain", "mtp"):
            with LlamaCppDriver(driver_path(workdir), *model_files(workdir, name), mode=mode) as d:
                got = [d.generate(p, max_tokens).tokens for p in prompts]
            same = sum(g == w for g, w in zip(got, want))
            print(f"{name} {mode}: {same}/{len(prompts)} prompts give mtpkit's {max_tokens} tokens")
            for i, (g, w) in enumerate(zip(got, want)):
                if g != w:
                    pos = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
                    failed.append(f"{name} {mode}: prompt {i} differs first at token {pos} "
                                  f"(llama.cpp {g[pos:pos + 4]}, mtpkit {w[pos:pos + 4]})")
                    break
    if failed:
        raise SystemExit("llama.cpp's greedy output is not mtpkit's:\n  " + "\n  ".join(failed))
    print("llama.cpp's greedy output equals mtpkit's: the baseline is ready "
          f"(python benchmarks/bench_cpu.py --llamacpp {workdir})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--force", action="store_true", help="reconvert the models")
    ap.add_argument("--skip-check", action="store_true")
    args = ap.parse_args()
    workdir = args.workdir.resolve()

    src = fetch_sources(workdir)
    patch_sources(src)
    build(workdir, src, args.jobs)   # incremental: seconds when only driver.cpp (or nothing) changed
    subprocess.run([sys.executable, str(HERE / "convert.py"), "--workdir", str(workdir)]
                   + (["--force"] if args.force else []), check=True)
    if not args.skip_check:
        check(workdir)


if __name__ == "__main__":
    main()
