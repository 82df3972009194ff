"""Qwen3-Next's configuration read from a Hugging Face `config.json`, validated on construction.

Only what the model needs is kept; unsupported values raise `ConfigError` naming the field,
the value and what is supported, before any weight is read.
"""

import dataclasses
import json
from pathlib import Path

from mtpkit.errors import ConfigError
from mtpkit.models.config_fields import (FLAG, OBJECT, POSITIVE, TEXT, TOKEN_IDS, Field, check_fields, count,
                                         raise_problems)

LINEAR, FULL = "linear_attention", "full_attention"

# Every config.json field from_dict reads, with its type and range (checked before any is used).
FIELDS: dict[str, Field] = {
    "model_type": TEXT, "text_config": OBJECT, "vocab_size": count(), "hidden_size": count(),
    "num_hidden_layers": count(), "num_attention_heads": count(), "num_key_value_heads": count(),
    "head_dim": count(), "intermediate_size": count(0), "layer_types": Field("strs"),
    "full_attention_interval": count(), "linear_num_key_heads": count(), "linear_num_value_heads": count(),
    "linear_key_head_dim": count(), "linear_value_head_dim": count(), "linear_conv_kernel_dim": count(2),
    "num_experts": count(0), "num_experts_per_tok": count(0), "moe_intermediate_size": count(0),
    "shared_expert_intermediate_size": count(0), "norm_topk_prob": FLAG, "decoder_sparse_step": count(),
    "mlp_only_layers": Field("ints", lo=0), "rms_norm_eps": POSITIVE, "rope_theta": POSITIVE,
    "partial_rotary_factor": Field("float", positive=True, hi=1), "rope_parameters": OBJECT,
    "rope_scaling": OBJECT, "max_position_embeddings": count(2), "tie_word_embeddings": FLAG,
    "eos_token_id": TOKEN_IDS, "bos_token_id": TOKEN_IDS, "pad_token_id": TOKEN_IDS,
    "num_nextn_predict_layers": count(0), "hidden_act": TEXT, "attention_bias": FLAG, "dtype": TEXT,
    "torch_dtype": TEXT,
}
ROPE_FIELDS: dict[str, Field] = {"rope_type": TEXT, "type": TEXT, "rope_theta": POSITIVE,
                                 "partial_rotary_factor": Field("float", positive=True, hi=1)}


@dataclasses.dataclass(frozen=True)
class Qwen3NextConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    # The checkpoint carries mtp.* weights but config.json has no field for them.
    num_nextn_predict_layers: int = 1
    torch_dtype: str | None = None
    model_type: str = "qwen3_next"

    # ---- derived sizes -------------------------------------------------------------
    @property
    def full_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR]

    @property
    def rot_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def is_moe_layer(self, i: int) -> bool:
        return (i not in self.mlp_only_layers and self.num_experts > 0
                and (i + 1) % self.decoder_sparse_step == 0)

    # ---- reading -------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | Path) -> "Qwen3NextConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise ConfigError(f"no config.json at {path}: give a checkpoint directory in Hugging Face layout")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(raw, where=str(path))

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config") -> "Qwen3NextConfig":
        raw = dict(raw)
        if "text_config" in raw and raw.get("model_type") != "qwen3_next":
            raw = {**raw["text_config"], "model_type": raw["text_config"].get("model_type")}
        mt = raw.get("model_type")
        if mt != "qwen3_next":
            raise ConfigError(f"{where}: model_type {mt!r} is not supported by the Qwen3-Next loader "
                              "(expected 'qwen3_next')")
        need = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads",
                "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim"]
        missing = [k for k in need if k not in raw]
        if missing:
            raise ConfigError(f"{where}: missing required fields {missing}")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        check_fields({**raw, **{f"rope_parameters.{k}": v for k, v in (rope.items() if isinstance(rope, dict) else ())}},
                     {**FIELDS, **{f"rope_parameters.{k}": f for k, f in ROPE_FIELDS.items()}}, where)
        n = int(raw["num_hidden_layers"])
        layer_types = raw.get("layer_types")
        if layer_types is None:
            interval = int(raw.get("full_attention_interval", 4))
            if interval < 1:
                raise ConfigError(f"{where}: full_attention_interval must be >= 1, got {interval}")
            layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n)]
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"{where}: rope_type {rope_type!r} is not supported (only 'default')")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{where}: hidden_act {act!r} is not supported (Qwen3-Next uses 'silu')")
        if raw.get("attention_bias", False):
            raise ConfigError(f"{where}: attention_bias=true is not supported (Qwen3-Next has no biases)")
        head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
        cfg = cls(
            vocab_size=int(raw["vocab_size"]), hidden_size=int(raw["hidden_size"]),
            num_hidden_layers=n, num_attention_heads=int(raw["num_attention_heads"]),
            num_key_value_heads=int(raw["num_key_value_heads"]), head_dim=int(head_dim),
            intermediate_size=int(raw.get("intermediate_size", 0)),
            layer_types=tuple(layer_types),
            linear_num_key_heads=int(raw["linear_num_key_heads"]),
            linear_num_value_heads=int(raw["linear_num_value_heads"]),
            linear_key_head_dim=int(raw["linear_key_head_dim"]),
            linear_value_head_dim=int(raw["linear_value_head_dim"]),
            linear_conv_kernel_dim=int(raw["linear_conv_kernel_dim"]),
            num_experts=int(raw.get("num_experts", 0)),
            num_experts_per_tok=int(raw.get("num_experts_per_tok", 0)),
            moe_intermediate_size=int(raw.get("moe_intermediate_size", 0)),
            shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size", 0)),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            decoder_sparse_step=int(raw.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            partial_rotary_factor=float(rope.get("partial_rotary_factor",
                                                 raw.get("partial_rotary_factor", 0.25))),
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids, bos_token_id=raw.get("bos_token_id"),
            pad_token_id=raw.get("pad_token_id"),
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 1),
            torch_dtype=raw.get("dtype", raw.get("torch_dtype")),
        )
        cfg.validate(where)
        return cfg

    def validate(self, where: str = "config") -> None:
        """Every problem of the values together, in one ConfigError."""
        bad = [t for t in self.layer_types if t not in (LINEAR, FULL)]
        checks = [
            (not bad, f"layer_types has unsupported values {sorted(set(bad))}; supported: {LINEAR!r}, {FULL!r}"),
            (len(self.layer_types) == self.num_hidden_layers,
             f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}"),
            (self.num_attention_heads % self.num_key_value_heads == 0,
             f"num_attention_heads={self.num_attention_heads} is not a multiple of "
             f"num_key_value_heads={self.num_key_value_heads}"),
            (self.linear_num_value_heads % self.linear_num_key_heads == 0,
             f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
             f"linear_num_key_heads={self.linear_num_key_heads}"),
            (self.rot_dim % 2 == 0 and 0 < self.rot_dim <= self.head_dim,
             f"partial_rotary_factor={self.partial_rotary_factor} with head_dim={self.head_dim} "
             f"gives {self.rot_dim} rotary dims; it must be even and in 1..head_dim"),
            (self.linear_conv_kernel_dim >= 2,
             f"linear_conv_kernel_dim={self.linear_conv_kernel_dim} must be >= 2"),
            (not any(self.is_moe_layer(i) for i in range(self.num_hidden_layers))
             or 1 <= self.num_experts_per_tok <= self.num_experts,
             f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts={self.num_experts}"),
            (all(0 <= i < self.num_hidden_layers for i in self.mlp_only_layers),
             f"mlp_only_layers={list(self.mlp_only_layers)} has indices outside 0..{self.num_hidden_layers - 1}"),
            (all(self.is_moe_layer(i) for i in range(self.num_hidden_layers)) or self.intermediate_size > 0,
             "dense MLP layers need intermediate_size > 0"),
            (not any(self.is_moe_layer(i) for i in range(self.num_hidden_layers)) or self.moe_intermediate_size > 0,
             "MoE layers need moe_intermediate_size > 0"),
        ]
        raise_problems(where, [msg for ok, msg in checks if not ok])
