"""Train the embedded default model (mtpkit/assets/tiny-qwen3-next) on a laptop CPU.

A small Qwen3-Next model (Gated DeltaNet and gated full attention in the real 3:1 pattern, a
sparse MoE with a shared expert in every layer) and its MTP head are trained jointly, with
mtpkit's own model (`mtpkit.models.qwen3_next.model`, torch attention backend) and autograd:

    loss = CE(next token) + sum_j mtp_weights[j] * CE(MTP pass j+1)  [+ router balance]

MTP pass 1 at position t takes the target's final hidden state h_t and the embedding of
token t+1 and predicts token t+2. With `mtp_depth` 2 a second, teacher-forced pass trains
the recursive use the engine makes of the one MTP layer for drafts 2..num_spec: at position
t it takes pass 1's output hidden at t-1 (and the embedding of token t+1) and predicts token
t+2 again, three tokens after the hidden state it started from (see `forward_losses`).

A second stage trains the MTP head alone (`--init-from` a checkpoint, `--train-part mtp`):
the target is frozen (so its outputs, and transformers parity, do not change), the MTP passes
are trained deeper (one loss weight per pass), and `--distill` mixes into each pass's loss the
cross-entropy to the target's own next-token distribution: greedy speculation accepts a draft
when it equals the target's argmax, not the data's next token.

Corpus, held-out split, tokenizer and training windows: training/corpus.py. The loop
(optimiser, schedule, logs, resumable state): training/loop.py.

A training batch of B windows of T tokens is one prefill step of B requests with fresh, zeroed
caches (the attention ops write them in place, which autograd records). Parameters are stored
in the checkpoint in bfloat16 under the Hugging Face names (`hf_state_dict`), with config.json
written by transformers' own Qwen3NextConfig so transformers loads the checkpoint too.

Run it with `python examples/train_tiny.py` (see `main` for the options).
"""

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from mtpkit.kernels.ops import TORCH
from mtpkit.step.metadata import PrefillChunk, PrefillMetadata, build_prefill
from mtpkit.models.qwen3_next.config import FULL, LINEAR, Qwen3NextConfig
from mtpkit.step.cache import CacheTensors, allocate_cache
from mtpkit.layers.norm import GatedRMSNorm, RMSNorm
from mtpkit.layers.linear import Linear
from mtpkit.checkpoint.loader import load_checkpoint
from mtpkit.layers.moe import SparseMoE
from mtpkit.models.qwen3_next.model import GatedDeltaNet, Qwen3NextForCausalLM
from mtpkit.shapes import Bool, Float, Int, Tensor
from training import loop
from training.checkpoint import DTYPES, dtype_name, hf_state_dict, verify_reload, write_checkpoint  # noqa: F401
from training.corpus import (EOS_ID, EOS_TOKEN, HELDOUT_EVERY, VOCAB_SIZE, build_tokenizer,  # noqa: F401
                             check_tokenizer, corpus_files, encode_bytes, heldout_documents, heldout_windows,
                             line_starts, load_split, sample_batch, sample_generated, split_files, stdlib_dir,
                             tokenizer_probe_texts)
from training.loop import lr_at, make_optimizer  # noqa: F401 (part of this module's interface)

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "mtpkit" / "assets" / "tiny-qwen3-next"

# ---------------------------------------------------------------------------------------
# Model sizes (Hugging Face Qwen3NextConfig kwargs)

_COMMON = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "intermediate_size": 512,  # unused: every layer is MoE
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "max_position_embeddings": 2048,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "eos_token_id": EOS_ID,
    "bos_token_id": None,
    "pad_token_id": None,
    "initializer_range": 0.02,
}


SIZES: dict[str, dict] = {
    # 4 layers (3 GDN + 1 full attention)
    "l4-e64": dict(_COMMON, num_hidden_layers=4, layer_types=[LINEAR] * 3 + [FULL],
                   moe_intermediate_size=64, shared_expert_intermediate_size=128),
    "l4-e96": dict(_COMMON, num_hidden_layers=4, layer_types=[LINEAR] * 3 + [FULL],
                   moe_intermediate_size=96, shared_expert_intermediate_size=192),
    # 8 layers (the 3:1 pattern twice), narrower experts to stay near the size budget
    "l8-e32": dict(_COMMON, num_hidden_layers=8, layer_types=([LINEAR] * 3 + [FULL]) * 2,
                   moe_intermediate_size=32, shared_expert_intermediate_size=64),
}
DEFAULT_SIZE = "l4-e64"


def hf_config(kwargs: dict, dtype: str = "bfloat16"):
    """transformers' Qwen3NextConfig for these kwargs (what config.json is written from)."""
    from transformers import Qwen3NextConfig as HFConfig
    return HFConfig(**json.loads(json.dumps(kwargs)), dtype=dtype, architectures=["Qwen3NextForCausalLM"])


def mtpkit_config(kwargs: dict) -> Qwen3NextConfig:
    """mtpkit's config, read from the same dict config.json holds."""
    return Qwen3NextConfig.from_dict(json.loads(hf_config(kwargs).to_json_string()), where="train.py")


# ---------------------------------------------------------------------------------------
# Model: build, initialise, export


def build_model(kwargs: dict, seed: int) -> Qwen3NextForCausalLM:
    model = Qwen3NextForCausalLM(mtpkit_config(kwargs), ops=TORCH, with_mtp=True)
    init_parameters(model, seed, kwargs.get("initializer_range", 0.02))
    for m in model.modules():
        if isinstance(m, SparseMoE) and hasattr(m, "dense_limit"):
            # Training steps (B*T tokens) take the grouped path, which runs only the experts each
            # token picks; the engine's dense small-step path would run all 8 for every token.
            m.dense_limit = 0
    return model


@torch.no_grad()
def init_parameters(model: Qwen3NextForCausalLM, seed: int, std: float = 0.02) -> None:
    """Hugging Face's Qwen3-Next init, except the GDN conv (see below); then requires_grad.

    normal(0, std): embeddings, lm_head, every linear, experts, router, shared-expert gate.
    Zero-centred RMSNorms (y = x * (1 + w)): 0. GDN gated norm: 1. A_log = log U(1, 16).
    dt_bias = 1 (HF). GDN conv1d: nn.Conv1d's default U(-1/sqrt(W), 1/sqrt(W)) instead of HF's
    normal(0.02), which starts the conv (and so q, k, v of every GDN layer) near zero."""
    g = torch.Generator().manual_seed(seed)
    modules = dict(model.named_modules())
    for name, p in model.named_parameters():
        owner_name, _, leaf = name.rpartition(".")
        owner = modules[owner_name] if owner_name else model
        if isinstance(owner, RMSNorm):
            p.zero_()
        elif isinstance(owner, GatedRMSNorm):
            p.fill_(1.0)
        elif isinstance(owner, GatedDeltaNet) and leaf == "A_log":
            p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=g).log_())
        elif isinstance(owner, GatedDeltaNet) and leaf == "dt_bias":
            p.fill_(1.0)
        elif isinstance(owner, GatedDeltaNet) and leaf == "conv_weight":
            bound = 1.0 / math.sqrt(p.shape[1])
            p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=g))
        elif isinstance(owner, (Linear, SparseMoE)) or name in ("embed_tokens", "lm_head"):
            p.copy_(torch.empty(p.shape).normal_(0.0, std, generator=g))
        else:
            raise AssertionError(f"no initialiser for parameter {name}")
    for p in model.parameters():
        p.requires_grad_(True)


def export_checkpoint(model: Qwen3NextForCausalLM, kwargs: dict, out_dir: Path,
                      dtype: torch.dtype = torch.bfloat16, verify: bool = True) -> Path:
    """Write config.json, generation_config.json, model.safetensors and tokenizer.json."""
    return write_checkpoint(out_dir, hf_config(kwargs, dtype_name(dtype)), hf_state_dict(model, dtype),
                            (lambda tmp: verify_export(model, tmp, dtype)) if verify else None)


def verify_export(model: Qwen3NextForCausalLM, path: Path, dtype: torch.dtype) -> None:
    """Reload with mtpkit's own loader: every parameter must come back (rounded to dtype)."""
    verify_reload(model, Qwen3NextForCausalLM(Qwen3NextConfig.from_file(path), ops=TORCH, with_mtp=True), path, dtype)


# ---------------------------------------------------------------------------------------
# Training


def fresh_cache(model: Qwen3NextForCausalLM, B: int, T: int) -> CacheTensors:
    """Zeroed caches for B requests of T tokens: one KV block of T tokens per request."""
    spec = model.cache_spec(model.cfg, num_spec=0) + model.mtp_cache_spec(model.cfg)
    return allocate_cache(spec, num_blocks=B + 1, num_slots=B + 1, block_size=T, dtype=model.embed_tokens.dtype,
                          device=torch.device("cpu"))


def prefill_step(B: int, T: int, inputs: Int[Tensor, "num_reqs seq_len"]):
    """token_ids, positions, metadata of a prefill of B fresh requests (block i+1, slot i+1)."""
    chunks = [PrefillChunk(inputs[i].tolist(), 0, [[i + 1]], [i + 1]) for i in range(B)]
    return build_prefill(chunks, block_size=T, max_blocks=1, device=torch.device("cpu"))


class RouterProbe:
    """Collects router logits of every SparseMoE call (forward hooks recompute them from the
    block's input: the router rows are part of the merged w_in, so gradients reach them) for
    the load-balancing loss: coef * E * sum_e f_e * P_e per MoE call (Switch Transformer)."""

    def __init__(self, model: Qwen3NextForCausalLM, topk: int):
        self.logits: list[torch.Tensor] = []
        self.topk = topk
        self.handles = [m.register_forward_hook(self._hook)
                        for m in model.modules() if isinstance(m, SparseMoE)]

    def _hook(self, module, inputs, output):
        self.logits.append(module.router_logits(inputs[0]))

    def loss(self) -> tuple[torch.Tensor, float]:
        """(balance loss averaged over MoE calls, max expert load fraction * E)."""
        total, worst, n = 0.0, 0.0, len(self.logits)
        for lg in self.logits:
            probs = torch.softmax(lg.float(), dim=-1)
            E = probs.shape[-1]
            chosen = torch.topk(probs, self.topk, dim=-1).indices
            f = torch.bincount(chosen.flatten(), minlength=E).float() / chosen.numel()
            total = total + E * (f * probs.mean(0)).sum()
            worst = max(worst, float(f.max()) * E)
        self.logits.clear()
        return total / max(n, 1) if n else torch.zeros(()), worst


def forward_losses(model: Qwen3NextForCausalLM, batch: Int[Tensor, "num_reqs seq_len"], mtp_depth: int = 1,
                   frozen_target: bool = False, distill: float = 0.0, mtp_keys: str = "own") -> dict:
    """Per-token mean losses of one batch [B, T + 2] (inputs are the first T tokens).

    ntp:      position t predicts token t+1 from the target's hidden h_t.
    mtp[0]:   position t, from h_t and embed(token t+1), predicts token t+2.
    mtp[j]:   position t >= j, from pass j's output at t-1 and embed(token t+1), predicts
              token t+2 (teacher-forced recursion; its own fresh MTP KV cache).

    frozen_target: the target runs without gradients (training the MTP head alone).
    mtp_keys: "own": pass j+1's attention reads its own K/V at every position (a fresh MTP
    cache); "inference": the keys the engine's pass j+1 reads (`inference_key_mask`).
    distill: weight in [0, 1] of the target's own distribution at t+1 (what greedy
    speculation must agree with) against the data token t+2 in each MTP pass's loss, at the
    positions where the target's next distribution is known (t <= T-2)."""
    B, T = batch.shape[0], batch.shape[1] - 2
    token_ids, positions, meta = prefill_step(B, T, batch[:, :T])
    cache = fresh_cache(model, B, T)
    with torch.set_grad_enabled(torch.is_grad_enabled() and not frozen_target):
        hidden = model(token_ids, positions, meta, cache)
        logits = model.compute_logits(hidden)
    targets1 = batch[:, 1:T + 1].reshape(-1)
    out = {"ntp": F.cross_entropy(logits, targets1), "mtp": []}
    # The target's distribution over token t+2 (its prediction at t+1), for t = 0..T-2.
    soft = torch.softmax(logits.detach().float().view(B, T, -1)[:, 1:], -1) if distill > 0 else None

    def mtp_loss(mtp_logits: Float[Tensor, "num_tokens vocab"], j: int) -> Float[Tensor, ""]:
        """Loss of pass j+1 at positions t >= j ([B, T, V] logits)."""
        lg = mtp_logits.view(B, T, -1)
        data = F.cross_entropy(lg[:, j:].reshape(-1, lg.shape[-1]), batch[:, 2 + j:T + 2].reshape(-1))
        if soft is None:
            return data
        logp = torch.log_softmax(lg[:, j:T - 1].float(), -1)
        return (1 - distill) * data - distill * (soft[:, j:] * logp).sum(-1).mean()

    h = model.mtp_forward(targets1, positions, hidden, meta, cache, step=0)
    out["mtp"].append(mtp_loss(model.compute_logits(h), 0))
    out["mtp_hidden"] = h
    pass_kv = [tuple(t[1:B + 1] for t in cache.kv["mtp"][0])]   # each pass's K, V [B, T, kv_heads, head_dim]
    for j in range(1, mtp_depth):
        # Pass j+1 at position t reads pass j's output at t-1; positions < j have no input.
        prev = h.view(B, T, -1)
        h_in = torch.cat([prev[:, :1], prev[:, :-1]], dim=1).reshape(B * T, -1)
        kv = {**cache.kv, "mtp": [tuple(torch.zeros_like(t) for t in cache.kv["mtp"][0])]}
        cache_j = dataclasses.replace(cache, kv=kv)
        if mtp_keys == "inference":
            h = _mtp_pass_inference_keys(model, targets1, positions, h_in, meta, cache_j, j, pass_kv, B, T)
            pass_kv.append(tuple(t[1:B + 1] for t in cache_j.kv["mtp"][0]))
        else:
            h = model.mtp_forward(targets1, positions, h_in, meta, cache_j, step=j)
        out["mtp"].append(mtp_loss(model.compute_logits(h), j))
    return out


def inference_key_mask(T: int, j: int) -> Bool[Tensor, "seq_len _"]:
    """[T, (j+1) T] bool: which (pass i, position s) keys pass j+1's query at position t sees
    when it runs as the engine runs it. Drafting from position p (the last accepted one), pass
    1 wrote the MTP layer's K/V at every position <= p and pass i+1 at p + i; pass j+1 runs at
    t = p + j. So its keys are pass 1's at s <= t - j and pass (i+1)'s at s = t - j + i for
    i = 1..j (the last one its own, which every query sees, also where t < j and there is
    no such p: those positions take no loss)."""
    t = torch.arange(T)[:, None]
    s = torch.arange(T)[None, :]
    return torch.cat([s <= t - j] + [s == t - j + i for i in range(1, j + 1)], dim=1) | \
        torch.cat([torch.zeros(T, j * T, dtype=torch.bool), s == t], dim=1)


def _mtp_pass_inference_keys(model: Qwen3NextForCausalLM, tokens: Int[Tensor, "num_tokens"],
                             positions: Int[Tensor, "num_tokens"], h_in: Float[Tensor, "num_tokens hidden"],
                             meta: PrefillMetadata, cache_j: CacheTensors, j: int, pass_kv: list, B: int, T: int
                             ) -> Float[Tensor, "num_tokens hidden"]:
    """MTP pass j+1 over every position, as `mtp_forward` computes it, except that attention
    reads the keys the engine's pass j+1 reads (`inference_key_mask`): earlier passes' K/V,
    not this pass's own at every position. Writes this pass's K/V to cache_j."""
    mtp = model.mtp
    x = mtp._input(model.embed(tokens), h_in)
    layer = mtp.layers[j % len(mtp.layers)]
    attn = layer.self_attn
    q, gate = attn._project(layer.input_layernorm(x), positions, meta.slot_mappings, cache_j)   # q [B*T, heads, D]
    k_all = torch.cat([kv[0] for kv in pass_kv] + [cache_j.kv["mtp"][0][0][1:B + 1]], dim=1)   # [B, (j+1) T, kvh, D]
    v_all = torch.cat([kv[1] for kv in pass_kv] + [cache_j.kv["mtp"][0][1][1:B + 1]], dim=1)
    qh = q.view(B, T, attn.heads, attn.hd).transpose(1, 2)
    kh, vh = k_all.transpose(1, 2), v_all.transpose(1, 2)
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=inference_key_mask(T, j), scale=attn.scale,
                                       enable_gqa=attn.heads != attn.kv_heads)
    o = o.transpose(1, 2).reshape(B * T, attn.heads * attn.hd) * torch.sigmoid(gate)
    x = x + attn.o_proj(o)
    x = x + layer.mlp(layer.post_attention_layernorm(x))
    return mtp.norm(x)


@dataclasses.dataclass
class TrainArgs:
    size: str = DEFAULT_SIZE
    steps: int = 1100
    batch: int = 8
    seq_len: int = 256
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.1
    clip: float = 1.0
    mtp_weights: tuple[float, ...] = (0.8, 0.4)
    balance_coef: float = 0.02
    seed: int = 0
    threads: int = 1
    work_dir: str = "/tmp/tiny-qwen3-next-run"
    out_dir: str = str(DEFAULT_OUT)
    save_every: int = 50
    eval_every: int = 200
    export_every: int = 400
    eval_windows: int = 16
    dtype: str = "bfloat16"
    line_aligned: bool = True
    top_level_fraction: float = 0.5
    # Second stage: start from a checkpoint and train only its MTP head (the target frozen),
    # with `distill` of each MTP pass's loss on the target's own next-token distribution.
    init_from: str | None = None
    train_part: str = "all"          # "all" | "mtp"
    distill: float = 0.0
    mtp_keys: str = "own"            # "own" | "inference" (see forward_losses)
    # Third stage: this share of each batch is drawn from the init checkpoint's own greedy
    # continuations of training-split prompts (see generate_continuations), made once.
    generated_fraction: float = 0.0
    generated_prompts: int = 2000
    generated_tokens: int = 200


def init_from_checkpoint(model: Qwen3NextForCausalLM, path: Path, kwargs: dict) -> None:
    """Load a checkpoint of this size into the training model (float32)."""
    cfg = Qwen3NextConfig.from_file(path)
    if cfg != mtpkit_config(kwargs):
        raise SystemExit(f"{path} is not a checkpoint of this --size")
    load_checkpoint(model, path, torch.float32, torch.device("cpu"))
    for p in model.parameters():
        p.requires_grad_(True)


def set_trainable(model: Qwen3NextForCausalLM, part: str) -> None:
    """"all": every parameter; "mtp": only the MTP head's (`mtp.*`). The embedding and lm_head
    the MTP passes share with the target stay frozen then: the target must not change."""
    if part not in ("all", "mtp"):
        raise ValueError(f"train_part must be 'all' or 'mtp', not {part!r}")
    for name, p in model.named_parameters():
        p.requires_grad_(part == "all" or name.startswith("mtp."))


@torch.no_grad()
def evaluate(model: Qwen3NextForCausalLM, windows: Int[Tensor, "num_reqs seq_len"], batch: int,
             mtp_depth: int = 1) -> dict:
    """Teacher-forced held-out metrics over fixed windows [N, T + 2], per token (nats):
    next-token loss and accuracy, MTP pass-1 loss and accuracy (token t+2), and how often the
    MTP draft at t agrees with the target's greedy token at t+1 (both predict token t+2)."""
    sums = {"ntp": 0.0, "ntp_acc": 0.0, "mtp1": 0.0, "mtp1_acc": 0.0}
    n = agree = n_agree = 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i:i + batch]
        B, T = w.shape[0], w.shape[1] - 2
        token_ids, positions, meta = prefill_step(B, T, w[:, :T])
        cache = fresh_cache(model, B, T)
        hidden = model(token_ids, positions, meta, cache)
        logits = model.compute_logits(hidden)
        t1, t2 = w[:, 1:T + 1].reshape(-1), w[:, 2:T + 2].reshape(-1)
        mlogits = model.compute_logits(model.mtp_forward(t1, positions, hidden, meta, cache, step=0))
        sums["ntp"] += F.cross_entropy(logits, t1, reduction="sum").item()
        sums["ntp_acc"] += (logits.argmax(-1) == t1).sum().item()
        sums["mtp1"] += F.cross_entropy(mlogits, t2, reduction="sum").item()
        sums["mtp1_acc"] += (mlogits.argmax(-1) == t2).sum().item()
        greedy_next = logits.argmax(-1).view(B, T)[:, 1:]
        agree += (mlogits.argmax(-1).view(B, T)[:, :-1] == greedy_next).sum().item()
        n, n_agree = n + t1.numel(), n_agree + greedy_next.numel()
    return {**{k: v / n for k, v in sums.items()}, "mtp1_agree": agree / n_agree, "tokens": n}


def generate_continuations(model_dir: Path, n: int, prompt_len: int, new_tokens: int, seed: int,
                           log=print, num_spec: int = 3) -> Int[Tensor, "num_reqs seq_len"]:
    """[n, prompt_len + new_tokens]: line-aligned training-split prompts (half of them at
    column-0 lines, as in training) followed by the checkpoint's greedy continuation. At
    inference the MTP passes read text the target wrote itself; its greedy continuations are
    that distribution (the engine decodes them with MTP, which is lossless)."""
    from mtpkit.llm import LLM
    from mtpkit.sampling.params import SamplingParams

    data = load_split("train")
    g = torch.Generator().manual_seed(seed + 777)
    starts = line_starts(data, prompt_len)
    windows = sample_batch(data, n, prompt_len - 2, g, starts, line_starts(data, prompt_len, top_level=True), 0.5)
    prompts = windows.tolist()
    llm = LLM(model_dir, num_spec=num_spec, max_num_seqs=32, dtype="float32", device="cpu",
              max_model_len=prompt_len + new_tokens + 8)
    t = time.time()
    outs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    log(f"generated {n} x {new_tokens} tokens in {time.time() - t:.0f} s "
        + (f"(acceptance {llm.stats.mean_acceptance_length:.2f})" if num_spec else ""))
    return torch.tensor([p + o.token_ids for p, o in zip(prompts, outs)], dtype=torch.int16)


def qwen_stage(a: TrainArgs, log=print) -> loop.Stage:
    """The tiny-qwen3-next stage `a` describes, for training.loop.run."""
    kwargs = SIZES[a.size]
    mtp_depth = len(a.mtp_weights)
    t_start = time.time()
    data = load_split("train")
    # Windows start at line starts: a prompt starts at one, and its first line's indentation
    # is then in view (windows at arbitrary bytes taught the model that a sequence starts deep
    # inside indented code, so greedy output after a bare "def f(n):" was all spaces).
    # Prompts usually start with top-level code (column 0): top_level_fraction of every batch
    # starts at such a line, so that is what the start of a sequence means to the model.
    starts = line_starts(data, a.seq_len) if a.line_aligned else None
    top_starts = line_starts(data, a.seq_len, top_level=True) if a.top_level_fraction > 0 else None
    val = heldout_windows(a.eval_windows, a.seq_len, a.seed)
    torch.manual_seed(a.seed)
    model = build_model(kwargs, a.seed)
    if a.init_from:
        init_from_checkpoint(model, Path(a.init_from), kwargs)
    set_trainable(model, a.train_part)
    generated, n_gen = None, round(a.batch * a.generated_fraction)
    if n_gen:
        if not (a.init_from and a.train_part == "mtp"):
            raise SystemExit("--generated-fraction needs --init-from and --train-part mtp: the data are "
                             "that checkpoint's own continuations, valid while its target stays frozen")
        generated = cached_continuations(Path(a.work_dir), Path(a.init_from), a.generated_prompts,
                                         a.generated_tokens, a.seed, a.seq_len, log)
    probe = RouterProbe(model, kwargs["num_experts_per_tok"]) if a.balance_coef > 0 else None
    mtp_cols = tuple(f"mtp{j + 1}" for j in range(max(mtp_depth, 2)))

    def step(i: int, g: torch.Generator):
        batch = sample_batch(data, a.batch, a.seq_len, g, starts, top_starts, a.top_level_fraction)
        if generated is not None:  # the last n_gen windows from the generated continuations
            batch[a.batch - n_gen:] = sample_generated(generated, n_gen, a.seq_len, g)
        out = forward_losses(model, batch, mtp_depth, a.train_part == "mtp", a.distill, a.mtp_keys)
        loss = (out["ntp"] if a.train_part == "all" else 0.0) + sum(w * l for w, l in zip(a.mtp_weights, out["mtp"]))
        # (The router probe's hooks also see the evaluation's forwards: their router logits
        # join the next step's balance loss, so --eval-every is part of a run's recipe. Kept
        # as it is: the embedded checkpoint was trained this way and its commands reproduce it.)
        bal, max_load = probe.loss() if probe is not None else (torch.zeros(()), 0.0)
        loss = loss + a.balance_coef * bal
        mtp = [l.item() for l in out["mtp"]] + [float("nan")] * max(2 - mtp_depth, 0)
        return loss, {"ntp": out["ntp"].item(), **dict(zip(mtp_cols, mtp)), "balance": bal.item(),
                      "max_load": max_load}

    n_params = sum(p.numel() for p in model.parameters())
    return loop.Stage(
        model=model, columns=("ntp", *mtp_cols, "balance", "max_load"), step=step,
        evaluate=lambda: evaluate(model, val, a.batch, mtp_depth),
        export=lambda d: export_checkpoint(model, kwargs, d, DTYPES[a.dtype]),
        tokens_per_step=a.batch * a.seq_len,
        summary={"size": a.size, "parameters": n_params, "train_tokens_available": int(data.numel())},
        close=lambda: [h.remove() for h in (probe.handles if probe is not None else [])],
        describe=f"size {a.size}: {n_params:,} parameters ({n_params * 2 / 1e6:.2f} MB in bf16); "
                 f"{data.numel():,} training tokens; {a.steps} steps of {a.batch}x{a.seq_len} tokens; "
                 f"data ready in {time.time() - t_start:.1f}s")


def cached_continuations(work: Path, init_from: Path, n: int, new_tokens: int, seed: int, seq_len: int,
                         log=print, num_spec: int = 3) -> Int[Tensor, "num_seqs total_len"]:
    """generate_continuations of init_from, made once into work/generated.pt."""
    work.mkdir(parents=True, exist_ok=True)
    gen_path = work / "generated.pt"
    if gen_path.exists():
        generated = torch.load(gen_path)
    else:
        generated = generate_continuations(init_from, n, 64, new_tokens, seed, log, num_spec=num_spec)
        torch.save(generated, gen_path)
    if generated.shape[1] < seq_len + 2:
        raise SystemExit(f"generated sequences of {generated.shape[1]} tokens are shorter than "
                         f"--seq-len + 2 = {seq_len + 2}; raise --generated-tokens")
    return generated


def train(a: TrainArgs, log=print) -> Qwen3NextForCausalLM:
    torch.set_num_threads(a.threads)
    return loop.run(qwen_stage(a, log), a, log)

def export_from_state(a: TrainArgs, log=print) -> Path:
    """Export the model saved in work_dir/train_state.pt (e.g. the final one) to out_dir."""
    st = torch.load(Path(a.work_dir) / "train_state.pt", weights_only=False)
    saved = TrainArgs(**{**dataclasses.asdict(TrainArgs()), **st["args"],
                         "mtp_weights": tuple(st["args"]["mtp_weights"])})
    model = build_model(SIZES[saved.size], saved.seed)
    model.load_state_dict(st["model"])
    out = export_checkpoint(model, SIZES[saved.size], Path(a.out_dir), DTYPES[saved.dtype])
    log(f"exported step {st['step']} of {a.work_dir} to {out}")
    return out


def benchmark(sizes: list[str], a: TrainArgs, steps: int = 4, log=print) -> None:
    """Training throughput (fwd + bwd + AdamW) of candidate sizes, after one warm-up step."""
    torch.set_num_threads(a.threads)
    data = load_split("heldout")  # any tokens do for timing
    for size in sizes:
        kwargs = SIZES[size]
        model = build_model(kwargs, a.seed)
        opt = make_optimizer(model, a)
        g = torch.Generator().manual_seed(0)
        n = sum(p.numel() for p in model.parameters())
        times = []
        for i in range(steps + 1):
            t = time.time()
            out = forward_losses(model, sample_batch(data, a.batch, a.seq_len, g), len(a.mtp_weights))
            loss = out["ntp"] + sum(w * l for w, l in zip(a.mtp_weights, out["mtp"]))
            opt.zero_grad()
            loss.backward()
            opt.step()
            times.append(time.time() - t)
        dt = sum(times[1:]) / steps
        log(f"{size}: {n:,} params ({n * 2 / 1e6:.2f} MB bf16), {a.batch}x{a.seq_len} mtp_depth "
            f"{len(a.mtp_weights)}: {dt:.2f} s/step, {a.batch * a.seq_len / dt:.0f} tok/s "
            f"(loss {loss.item():.3f})")


def main(argv: list[str] | None = None) -> None:
    d = TrainArgs()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default=d.size)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--mtp-weights", type=float, nargs="+", default=list(d.mtp_weights),
                   help="loss weight of each MTP pass (their number is the MTP training depth)")
    p.add_argument("--balance-coef", type=float, default=d.balance_coef)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--work-dir", default=d.work_dir, help="training state, loss.tsv, eval.tsv, export/")
    p.add_argument("--out-dir", default=d.out_dir, help="where the final checkpoint is written")
    p.add_argument("--save-every", type=int, default=d.save_every)
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--export-every", type=int, default=d.export_every)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=d.dtype, help="checkpoint dtype")
    p.add_argument("--no-line-aligned", dest="line_aligned", action="store_false",
                   help="start training windows at any byte instead of at line starts")
    p.add_argument("--top-level-fraction", type=float, default=d.top_level_fraction,
                   help="fraction of each batch whose windows start at a column-0 line")
    p.add_argument("--init-from", default=d.init_from, help="start from this checkpoint directory")
    p.add_argument("--train-part", choices=["all", "mtp"], default=d.train_part,
                   help="mtp: train only the MTP head (the target frozen)")
    p.add_argument("--distill", type=float, default=d.distill,
                   help="weight of the target's next-token distribution in each MTP pass's loss (0..1)")
    p.add_argument("--mtp-keys", choices=["own", "inference"], default=d.mtp_keys,
                   help="what MTP passes 2.. attend to: their own K/V, or the keys the engine's passes read")
    p.add_argument("--generated-fraction", type=float, default=d.generated_fraction,
                   help="share of each batch drawn from the --init-from checkpoint's own greedy "
                        "continuations (made once into --work-dir/generated.pt; needs --train-part mtp)")
    p.add_argument("--generated-prompts", type=int, default=d.generated_prompts)
    p.add_argument("--generated-tokens", type=int, default=d.generated_tokens)
    p.add_argument("--bench", nargs="*", metavar="SIZE",
                   help="only measure training throughput of these sizes (all when none given)")
    p.add_argument("--export-only", action="store_true",
                   help="only export the model saved in --work-dir/train_state.pt to --out-dir")
    p.add_argument("--quick", action="store_true",
                   help="a 12-step smoke run into a temporary work/out dir (checks the whole path)")
    args = p.parse_args(argv)
    a = TrainArgs(size=args.size, steps=args.steps, batch=args.batch, seq_len=args.seq_len, lr=args.lr,
                  warmup=args.warmup, mtp_weights=tuple(args.mtp_weights), balance_coef=args.balance_coef,
                  seed=args.seed, threads=args.threads, work_dir=args.work_dir, out_dir=args.out_dir,
                  save_every=args.save_every, eval_every=args.eval_every, export_every=args.export_every,
                  dtype=args.dtype, line_aligned=args.line_aligned,
                  top_level_fraction=args.top_level_fraction, init_from=args.init_from,
                  train_part=args.train_part, distill=args.distill, mtp_keys=args.mtp_keys,
                  generated_fraction=args.generated_fraction, generated_prompts=args.generated_prompts,
                  generated_tokens=args.generated_tokens)
    def log(s: str) -> None:
        print(s, flush=True)

    if args.bench is not None:
        benchmark(args.bench or sorted(SIZES), a, log=log)
        return
    if args.export_only:
        export_from_state(a, log=log)
        return
    if args.quick:
        import tempfile
        root = Path(tempfile.mkdtemp(prefix="mtpkit-train-quick-"))
        a = dataclasses.replace(a, steps=12, warmup=4, save_every=5, eval_every=6, export_every=6,
                                eval_windows=4, work_dir=str(root / "work"), out_dir=str(root / "out"),
                                generated_prompts=min(a.generated_prompts, 8))
    train(a, log=log)


if __name__ == "__main__":
    main()
