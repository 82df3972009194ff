"""tiny-gemma4's target model: a small Gemma 4 text decoder (model_type `gemma4_text`), trained
with mtpkit's own model (`mtpkit.models.gemma4.model`, torch attention backend) and autograd on the
corpus of training/corpus.py, next-token cross-entropy only.

Architecture (see SIZES): six layers, five sliding-window layers then one full-attention
layer (Gemma 4's 5:1 pattern, last layer full), a window of 64 tokens (shorter than the
prompts it is benchmarked on), full layers with their own head_dim (128 against 64) and one
KV head shared as K and V (`attention_k_eq_v`), q/k/v norms, proportional RoPE on full
layers, gelu-tanh MLPs, a trained `layer_scalar` per layer, tied embeddings and final logit
softcapping at 30. Dense, not MoE: on one CPU thread a MoE step (routing, grouped experts)
costs several times the FLOPs it saves at this size, and a MoE target gains less from
speculation (a verify bundle of k+1 tokens touches more experts than one token does).

Vocabulary: the tokenizer's 257 ids padded with unused ids to 272 = 16 x 17 rows, so that the
assistant's ordered-embedding path (16 centroids of 17 tokens) can be tried; ids 257..271
never occur in the data and never win an argmax.

A training batch of B windows of T tokens is one prefill step of B fresh requests with zeroed
caches (as in training/train.py), so the training forward is the engine's forward.
"""

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from mtpkit.kernels.ops import TORCH
from mtpkit.step.metadata import PrefillChunk, PrefillMetadata, build_prefill
from mtpkit.step.cache import CacheTensors, allocate_cache
from mtpkit.models.gemma4.model import Gemma4ForCausalLM, GemmaRMSNorm
from mtpkit.models.gemma4.config import FULL, SLIDING, Gemma4Config
from mtpkit.layers.linear import Linear
from mtpkit.shapes import Float, Int, Tensor
from training.checkpoint import dtype_name, hf_state_dict, verify_reload, write_checkpoint
from training.corpus import EOS_ID

VOCAB_SIZE = 272
NAME = "tiny-gemma4"
DEFAULT_DRAFTER = "tiny-gemma4-assistant"
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "mtpkit" / "assets" / NAME

ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}

_COMMON = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 6,
    "layer_types": [SLIDING] * 5 + [FULL],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,          # sliding layers
    "head_dim": 64,                    # sliding layers
    "global_head_dim": 128,            # full layers
    "num_global_key_value_heads": 1,   # full layers (attention_k_eq_v: one projection for K and V)
    "attention_k_eq_v": True,
    "sliding_window": 64,
    "final_logit_softcapping": 30.0,
    "hidden_size_per_layer_input": 0,  # no per-layer embeddings
    "vocab_size_per_layer_input": 0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    "rope_parameters": ROPE,
    "eos_token_id": EOS_ID,
    "bos_token_id": None,
    "pad_token_id": None,
    "initializer_range": 0.02,
}

SIZES: dict[str, dict] = {
    "l6-h256": dict(_COMMON),
    "l6-h256-i1024": dict(_COMMON, intermediate_size=1024),
    "l6-h192": dict(_COMMON, hidden_size=192, num_attention_heads=3, num_key_value_heads=1, intermediate_size=512),
}
DEFAULT_SIZE = "l6-h256"


def hf_config(kwargs: dict, dtype: str = "bfloat16"):
    """transformers' Gemma4TextConfig for these kwargs (what config.json is written from)."""
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(**json.loads(json.dumps(kwargs)), dtype=dtype, architectures=["Gemma4ForCausalLM"])


def mtpkit_config(kwargs: dict) -> Gemma4Config:
    """mtpkit's config, read from the same dict config.json holds."""
    return Gemma4Config.from_dict(json.loads(hf_config(kwargs).to_json_string()), where="gemma4_target.py")


def config_of(path: Path) -> Gemma4Config:
    return Gemma4Config.from_dict(json.loads((Path(path) / "config.json").read_text()), where=str(path))


def build_model(cfg: Gemma4Config, seed: int) -> Gemma4ForCausalLM:
    model = Gemma4ForCausalLM(cfg, ops=TORCH)
    init_parameters(model, seed, 0.02)
    return model


@torch.no_grad()
def init_parameters(model: Gemma4ForCausalLM, seed: int, std: float = 0.02) -> None:
    """transformers' Gemma 4 init: normal(0, std) for the embedding (the tied head) and every
    linear; 1 for the norms' weights and layer_scalar. Then every parameter requires grad."""
    g = torch.Generator().manual_seed(seed)
    modules = dict(model.named_modules())
    for name, p in model.named_parameters():
        owner_name, _, leaf = name.rpartition(".")
        owner = modules[owner_name] if owner_name else model
        if isinstance(owner, GemmaRMSNorm) or leaf == "layer_scalar":
            p.fill_(1.0)
        elif isinstance(owner, Linear) or name in ("embed_tokens", "lm_head"):
            p.copy_(torch.empty(p.shape).normal_(0.0, std, generator=g))
        else:
            raise AssertionError(f"no initialiser for parameter {name}")
    for p in model.parameters():
        p.requires_grad_(True)


def load_into(model: Gemma4ForCausalLM, path: Path) -> None:
    """A checkpoint of this config into the training model (float32)."""
    from mtpkit.checkpoint.loader import load_checkpoint

    if config_of(path) != model.cfg:
        raise SystemExit(f"{path} is not a checkpoint of this --size")
    load_checkpoint(model, path, torch.float32, torch.device("cpu"))


def export_checkpoint(model: Gemma4ForCausalLM, kwargs: dict, out_dir: Path, dtype: torch.dtype = torch.bfloat16,
                      default_drafter: str | None = DEFAULT_DRAFTER) -> Path:
    """config.json, generation_config.json, model.safetensors, tokenizer.json and mtpkit.json
    (the name of the default drafter, for `LLM("tiny-gemma4", num_spec=k)`)."""
    def verify(tmp: Path) -> None:
        verify_reload(model, Gemma4ForCausalLM(config_of(tmp), ops=TORCH), tmp, dtype)

    extra = {"mtpkit.json": {"default_drafter": default_drafter}} if default_drafter else None
    return write_checkpoint(out_dir, hf_config(kwargs, dtype_name(dtype)), hf_state_dict(model, dtype), verify,
                            extra_json=extra)


# ---------------------------------------------------------------------------------------
# Forward and losses


def fresh_cache(model: Gemma4ForCausalLM, B: int, T: int) -> CacheTensors:
    """Zeroed KV for B requests of T tokens: one block of T tokens per request (block i+1) in
    every KV pool (full attention, the sliding window's)."""
    return allocate_cache(model.cache_spec(model.cfg, num_spec=0), num_blocks=B + 1, num_slots=1, block_size=T,
                          dtype=model.embed_tokens.dtype, device=torch.device("cpu"))


def prefill_step(cache: CacheTensors, inputs: list[list[int]]
                 ) -> tuple[Int[Tensor, "num_tokens"], Int[Tensor, "num_tokens"], PrefillMetadata]:
    """token_ids, positions, metadata of a prefill of fresh requests (request i in block i+1
    of every pool; ragged lengths allowed, each at most the cache's block size)."""
    pools = len(cache.pool_windows)
    chunks = [PrefillChunk(ids, 0, [[i + 1]] * pools, []) for i, ids in enumerate(inputs)]
    return build_prefill(chunks, block_size=cache.block_size, max_blocks=1, device=torch.device("cpu"))


def run_target(model: Gemma4ForCausalLM, inputs: Int[Tensor, "num_reqs seq_len"]
               ) -> tuple[Float[Tensor, "num_tokens hidden"], Float[Tensor, "num_tokens vocab"], CacheTensors]:
    """(final normed hidden states, logits, the KV cache it wrote) of B sequences of T tokens."""
    B, T = inputs.shape
    cache = fresh_cache(model, B, T)
    token_ids, positions, meta = prefill_step(cache, inputs.tolist())
    hidden = model(token_ids, positions, meta, cache)
    return hidden, model.compute_logits(hidden), cache


def ntp_loss(model: Gemma4ForCausalLM, batch: Int[Tensor, "num_reqs seq_len"]) -> Float[Tensor, ""]:
    """Mean next-token cross-entropy of a batch [B, T + 1] (inputs: the first T tokens)."""
    _, logits, _ = run_target(model, batch[:, :-1])
    return F.cross_entropy(logits, batch[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model: Gemma4ForCausalLM, windows: Int[Tensor, "num_reqs seq_len"], batch: int) -> dict:
    """Teacher-forced next-token loss (nats) and accuracy over fixed windows [N, T + 1]."""
    loss = acc = n = 0.0
    for i in range(0, windows.shape[0], batch):
        w = windows[i:i + batch]
        _, logits, _ = run_target(model, w[:, :-1])
        t = w[:, 1:].reshape(-1)
        loss += F.cross_entropy(logits, t, reduction="sum").item()
        acc += (logits.argmax(-1) == t).sum().item()
        n += t.numel()
    return {"ntp": loss / n, "ntp_acc": acc / n, "tokens": n}
