"""Writing an embedded checkpoint directory in Hugging Face layout (every model's stages)."""

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from training.corpus import EOS_ID, build_tokenizer

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


def write_checkpoint(out_dir: Path, hf_config, tensors: dict[str, torch.Tensor],
                     verify: Callable[[Path], None] | None = None, generation: dict | None = None,
                     extra_json: dict[str, dict] | None = None) -> Path:
    """config.json (written by the transformers config object `hf_config`),
    generation_config.json (eos <|endoftext|> and `generation`), model.safetensors
    (`tensors` as given), tokenizer.json and `extra_json` files, built in a temporary
    directory, checked by `verify(tmp)`, then moved into out_dir (other files there, such as
    README.md, stay)."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    hf_config.save_pretrained(str(tmp))
    GenerationConfig(eos_token_id=EOS_ID, **(generation or {})).save_pretrained(str(tmp))
    save_file({n: t.detach().cpu().contiguous() for n, t in tensors.items()}, str(tmp / "model.safetensors"),
              metadata={"format": "pt"})
    build_tokenizer().save(str(tmp / "tokenizer.json"))
    for name, obj in (extra_json or {}).items():
        (tmp / name).write_text(json.dumps(obj, indent=2) + "\n")
    if verify is not None:
        verify(tmp)
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in tmp.iterdir():
        f.chmod(0o644)  # safetensors writes 0600; the files ship as package data
        os.replace(f, out_dir / f.name)
    tmp.rmdir()
    return out_dir


def hf_state_dict(model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """An mtpkit model's parameters under their Hugging Face checkpoint names and shapes, in
    `dtype` (the loader's inverse, mtpkit.checkpoint.loader.export_state_dict)."""
    from mtpkit.checkpoint.loader import export_state_dict

    return {n: t.detach().to("cpu", dtype).contiguous().clone() for n, t in export_state_dict(model).items()}


@torch.no_grad()
def verify_reload(model: torch.nn.Module, fresh: torch.nn.Module, path: Path, dtype: torch.dtype) -> None:
    """Load `path` into `fresh` (an empty model of the same config) with mtpkit's own loader:
    every parameter of `model` must come back, rounded to dtype; and the tokenizer must
    round-trip text."""
    from tokenizers import Tokenizer

    from mtpkit.checkpoint.loader import load_checkpoint
    from training.corpus import check_tokenizer, tokenizer_probe_texts

    load_checkpoint(fresh, path, torch.float32, torch.device("cpu"))
    theirs = dict(fresh.named_parameters())
    for name, p in model.named_parameters():
        if not torch.equal(theirs[name], p.detach().to(dtype).float()):
            raise AssertionError(f"exported checkpoint does not reload {name} exactly")
    check_tokenizer(Tokenizer.from_file(str(path / "tokenizer.json")), tokenizer_probe_texts())
