"""Converts the embedded models to f32 GGUF for llama.cpp, with llama.cpp's own
convert_hf_to_gguf.py (the vendored tree benchmarks/llamacpp/build.py fetched; its gguf-py).

    python benchmarks/llamacpp/convert.py --workdir ~/.cache/mtpkit-llamacpp

Writes WORKDIR/models/{tiny-qwen3-next,tiny-gemma4,tiny-gemma4-assistant}.gguf. What the
converter cannot take as shipped, and what is done about it (on a temporary copy of each
checkpoint; the models themselves are untouched, and the real Qwen3-Next / Gemma 4 need none):
- The byte-level 257-token tokenizer: the converter does not know its pre-tokenizer hash
  (written as "default") and GGUF wants a merges list, rejecting an empty one: one merge that
  can never apply ("ĀĀ ĀĀ": no merge makes "ĀĀ"). With no effective merge llama.cpp's BPE maps
  id = byte; the driver feeds token ids anyway. Gemma 4 goes the same (gpt2-style) way: its
  converter expects a SentencePiece-style vocabulary.
- tiny-qwen3-next has gated-delta-net key heads of 32 and value heads of 64, and llama.cpp's
  op wants equal sizes: each q/k head is zero-padded to 64 (in_proj_qkvz rows, conv1d
  channels), exact for the dot products and the L2 norms; the original size goes into the
  GGUF as `mtpkit.ssm_key_head_dim` for build.py's q rescale in qwen3next.cpp. Its MTP head
  (`mtp.*`) converts to the `nextn` layer llama.cpp's draft-mtp runs.
- Gemma 4: the converter trims the embedding rows to the tokenizer's 257 tokens, but the model
  has 272 rows and its logits cover all of them: the copy's tokenizer lists 15 unused tokens.
"""

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
ASSETS = REPO / "mtpkit" / "assets"
MODELS = ("tiny-qwen3-next", "tiny-gemma4", "tiny-gemma4-assistant")
NEVER_APPLYING_MERGE = "ĀĀ ĀĀ"


def pad_qwen3next_key_heads(src: Path, dst: Path) -> int:
    """Copies the checkpoint with every GDN q/k head zero-padded to the value head size;
    returns the original key head size."""
    import torch
    from safetensors.torch import load_file, save_file

    cfg = json.loads((src / "config.json").read_text())
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    pad = dv - dk
    tensors = load_file(src / "model.safetensors")
    if pad > 0:
        for name, w in list(tensors.items()):
            if name.endswith("linear_attn.in_proj_qkvz.weight"):   # per key head: q, k, v, z rows
                g = w.view(nk, -1, w.shape[-1])
                q, k, vz = torch.split(g, [dk, dk, g.shape[1] - 2 * dk], dim=1)
                zeros = g.new_zeros(nk, pad, w.shape[-1])
                tensors[name] = torch.cat([q, zeros, k, zeros, vz], dim=1).reshape(-1, w.shape[-1])
            elif name.endswith("linear_attn.conv1d.weight"):       # channels: q heads, k heads, v
                q, k, v = torch.split(w, [nk * dk, nk * dk, nv * dv], dim=0)
                q, k = (t.view(nk, dk, *w.shape[1:]) for t in (q, k))
                zeros = w.new_zeros(nk, pad, *w.shape[1:])
                q, k = (torch.cat([t, zeros], dim=1).reshape(nk * dv, *w.shape[1:]) for t in (q, k))
                tensors[name] = torch.cat([q, k, v], dim=0)
        cfg["linear_key_head_dim"] = dv
    save_file({k: v.contiguous() for k, v in tensors.items()}, dst / "model.safetensors")
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dk


def pad_tokenizer(dst: Path, n_rows: int) -> None:
    """Lists unused tokens up to the embedding's row count, so the converter keeps every row."""
    tok = json.loads((dst / "tokenizer.json").read_text())
    n = len(tok["model"]["vocab"]) + len(tok["added_tokens"])
    for i in range(n, n_rows):
        tok["added_tokens"].append({"id": i, "content": f"<unused{i}>", "single_word": False,
                                    "lstrip": False, "rstrip": False, "normalized": False,
                                    "special": True})
    (dst / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))


def load_converter(llama_cpp: Path):
    """The vendored converter as a module, with the tokenizer handling the tiny models need."""
    sys.path.insert(0, str(llama_cpp))
    sys.path.insert(1, str(llama_cpp / "gguf-py"))
    import convert_hf_to_gguf as conv
    from conversion import base, gemma, qwen

    def get_vocab_base_pre(self, tokenizer):
        return "default"   # the byte-level tokenizer's hash is in no table

    def set_vocab_bytes(self):
        self._set_vocab_gpt2()
        self.gguf_writer.add_token_merges([NEVER_APPLYING_MERGE])

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    gemma.Gemma4Model.set_vocab = set_vocab_bytes
    qwen.Qwen3NextModel.set_vocab = set_vocab_bytes
    return conv, qwen


def convert(llama_cpp: Path, out_dir: Path, force: bool = False) -> dict[str, Path]:
    import torch

    conv, qwen = load_converter(llama_cpp)
    out_dir.mkdir(parents=True, exist_ok=True)
    done = {}
    for name in MODELS:
        out = out_dir / f"{name}.gguf"
        done[name] = out
        if out.is_file() and not force:
            continue
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            ckpt = Path(tmp) / name
            shutil.copytree(ASSETS / name, ckpt)
            extra = {}
            if name == "tiny-qwen3-next":
                extra["mtpkit.ssm_key_head_dim"] = pad_qwen3next_key_heads(ASSETS / name, ckpt)
            else:
                cfg = json.loads((ckpt / "config.json").read_text())
                pad_tokenizer(ckpt, cfg.get("text_config", cfg)["vocab_size"])
            orig = qwen.Qwen3NextModel.set_gguf_parameters

            def set_gguf_parameters(self, orig=orig, extra=extra):
                orig(self)
                for key, value in extra.items():
                    self.gguf_writer.add_uint32(key, value)

            qwen.Qwen3NextModel.set_gguf_parameters = set_gguf_parameters
            argv = sys.argv
            sys.argv = ["convert_hf_to_gguf.py", str(ckpt), "--outtype", "f32", "--outfile", str(out)]
            try:
                with torch.inference_mode(False):
                    conv.main()
            finally:
                sys.argv = argv
                qwen.Qwen3NextModel.set_gguf_parameters = orig
        print(f"wrote {out}")
    return done


def main() -> None:
    sys.path.insert(0, str(HERE))
    from build import DEFAULT_WORKDIR, llama_cpp_dir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    ap.add_argument("--force", action="store_true", help="reconvert models already there")
    args = ap.parse_args()
    src = llama_cpp_dir(args.workdir.resolve())
    if not (src / "convert_hf_to_gguf.py").is_file():
        raise SystemExit(f"no llama.cpp tree at {src}: run python benchmarks/llamacpp/build.py first")
    convert(src, args.workdir.resolve() / "models", args.force)


if __name__ == "__main__":
    main()
