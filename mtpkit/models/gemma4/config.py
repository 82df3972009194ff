"""Gemma 4's text-decoder configuration read from a Hugging Face `config.json`, validated on
construction.

Two layouts: model_type `gemma4_text` (Gemma4ForCausalLM, weights `model.*`) and `gemma4`
(Gemma4ForConditionalGeneration, how the hub ships it: the decoder's fields under
`text_config`, weights under `model.language_model.*`). Omitted fields take transformers
5.24's class defaults (Gemma4TextConfig), which is what a checkpoint means by omitting them:
per-layer embeddings on (hidden_size_per_layer_input=256), no final softcap, window 512, a
5:1 sliding/full pattern, full layers with head_dim `global_head_dim` (512). Every value
mtpkit does not implement is a ConfigError naming it, before any weight is read.
"""

import dataclasses

from mtpkit.errors import ConfigError
from mtpkit.models.config_fields import (FLAG, OBJECT, POSITIVE, TEXT, TOKEN_IDS, Field, check_fields, count,
                                         raise_problems)

SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = (SLIDING, FULL)


@dataclasses.dataclass(frozen=True)
class RopeType:
    theta: float
    partial_rotary_factor: float = 1.0     # "proportional": the rotated fraction of head_dim
    proportional: bool = False


# Every config.json field from_dict reads, with its type and range (checked before any is used;
# per_layer_config's and rope_parameters' entries are checked where they are read).
FIELDS: dict[str, Field] = {
    "model_type": TEXT, "text_config": OBJECT, "vocab_size": count(), "hidden_size": count(),
    "intermediate_size": count(), "num_hidden_layers": count(), "num_attention_heads": count(),
    "num_key_value_heads": count(), "head_dim": count(2), "hidden_activation": TEXT, "attention_bias": FLAG,
    "use_bidirectional_attention": FLAG, "layer_types": Field("strs"), "attention_k_eq_v": FLAG,
    "rope_parameters": OBJECT, "num_kv_shared_layers": count(0), "enable_moe_block": FLAG,
    "num_experts": count(0), "top_k_experts": count(0), "moe_intermediate_size": count(0),
    "sliding_window": count(), "final_logit_softcapping": POSITIVE, "eos_token_id": TOKEN_IDS,
    "hidden_size_per_layer_input": count(0), "rms_norm_eps": POSITIVE, "vocab_size_per_layer_input": count(0),
    "use_double_wide_mlp": FLAG, "tie_word_embeddings": FLAG, "max_position_embeddings": count(2),
    "torch_dtype": TEXT, "dtype": TEXT, "per_layer_config": OBJECT, "global_head_dim": count(2),
    "num_global_key_value_heads": count(),
}


@dataclasses.dataclass(frozen=True)
class Gemma4Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    layer_types: tuple[str, ...]
    head_dims: tuple[int, ...]             # per layer
    kv_heads: tuple[int, ...]              # per layer
    sliding_window: int
    rope: dict                             # layer type -> RopeType
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float | None = None
    hidden_size_per_layer_input: int = 0   # 0: no per-layer embeddings
    vocab_size_per_layer_input: int = 0
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    enable_moe_block: bool = False
    num_experts: int = 0
    top_k_experts: int = 0
    moe_intermediate_size: int = 0
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 131072
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    multimodal: bool = False               # the gemma4 (ForConditionalGeneration) layout
    model_type: str = "gemma4_text"

    # ---- derived --------------------------------------------------------------------
    @property
    def first_shared_layer(self) -> int:
        return self.num_hidden_layers - self.num_kv_shared_layers

    def kv_source(self, i: int) -> int:
        """The layer whose KV layer i reads: itself, or (a KV-shared layer) the last
        non-shared layer of its type."""
        if i < self.first_shared_layer:
            return i
        return max(j for j in range(self.first_shared_layer) if self.layer_types[j] == self.layer_types[i])

    def window(self, i: int) -> int | None:
        return self.sliding_window if self.layer_types[i] == SLIDING else None

    def intermediate(self, i: int) -> int:
        wide = self.use_double_wide_mlp and i >= self.first_shared_layer
        return self.intermediate_size * (2 if wide else 1)

    # ---- reading -------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict, where: str = "config") -> "Gemma4Config":
        multimodal = raw.get("model_type") == "gemma4"
        if multimodal:
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError(f"{where}: model_type 'gemma4' needs a text_config object (the text decoder)")
            # eos may sit on the wrapper only; the decoder's own value wins.
            raw = {"eos_token_id": raw.get("eos_token_id"), **text, "model_type": text.get("model_type", "gemma4_text")}
        mt = raw.get("model_type")
        if mt != "gemma4_text":
            raise ConfigError(f"{where}: model_type {mt!r} is not a Gemma 4 text decoder "
                              "(expected 'gemma4_text', or 'gemma4' with a text_config)")
        if multimodal:
            where = f"{where} text_config"
        need = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim"]
        missing = [k for k in need if k not in raw]
        if missing:
            raise ConfigError(f"{where}: missing required fields {missing}")
        check_fields(raw, FIELDS, where)
        problems = []

        def unsupported(field, value, supported):
            problems.append(f"{field}={value!r} is not supported ({supported})")

        if raw.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            unsupported("hidden_activation", raw["hidden_activation"], "only 'gelu_pytorch_tanh'")
        if raw.get("attention_bias", False):
            unsupported("attention_bias", raw["attention_bias"], "only false")
        if raw.get("use_bidirectional_attention") is not None:
            unsupported("use_bidirectional_attention", raw["use_bidirectional_attention"],
                        "only null: causal text decoding")
        n = int(raw["num_hidden_layers"])
        layer_types = raw.get("layer_types")
        if layer_types is None:   # transformers' default: 5 sliding, 1 full
            layer_types = [SLIDING if (i + 1) % 6 else FULL for i in range(n)]
        layer_types = list(layer_types)
        bad = sorted({t for t in layer_types if t not in LAYER_TYPES})
        if bad:
            unsupported("layer_types", bad, f"only {list(LAYER_TYPES)}")
        if len(layer_types) != n:
            problems.append(f"layer_types has {len(layer_types)} entries but num_hidden_layers={n}")
        elif layer_types and layer_types[-1] != FULL:
            # transformers forces the last layer to full attention (with a warning): so do we.
            layer_types[-1] = FULL
        k_eq_v = bool(raw.get("attention_k_eq_v", False))
        head_dims, kv_heads = cls._per_layer(raw, layer_types, k_eq_v, where, problems)
        rope = cls._rope(raw.get("rope_parameters"), layer_types, problems)
        shared = int(raw.get("num_kv_shared_layers", 0) or 0)
        if not 0 <= shared < n:
            problems.append(f"num_kv_shared_layers={shared} must be in 0..{n - 1} (some layer must compute KV)")
        elif shared and not set(layer_types) <= set(layer_types[:n - shared]):
            problems.append("num_kv_shared_layers: every layer type of the shared layers needs a non-shared layer of "
                            "that type before them")
        moe = bool(raw.get("enable_moe_block", False))
        experts = int(raw.get("num_experts") or 0)
        top_k = int(raw.get("top_k_experts") or 0)
        moe_inter = int(raw.get("moe_intermediate_size") or 0)
        if moe and not (experts > 0 and 0 < top_k <= experts and moe_inter > 0):
            problems.append(f"enable_moe_block needs num_experts > 0, 0 < top_k_experts <= num_experts and "
                            f"moe_intermediate_size > 0 (got {experts}, {top_k}, {moe_inter})")
        window = int(raw.get("sliding_window", 512))
        if window < 1:
            problems.append(f"sliding_window={window} must be >= 1")
        softcap = raw.get("final_logit_softcapping")
        if softcap is not None and not float(softcap) > 0:
            problems.append(f"final_logit_softcapping={softcap!r} must be positive or null")
        raise_problems(where, problems)
        eos = raw.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
        ple = int(raw.get("hidden_size_per_layer_input", 256) or 0)
        return cls(
            vocab_size=int(raw["vocab_size"]), hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]), num_hidden_layers=n,
            num_attention_heads=int(raw["num_attention_heads"]), layer_types=tuple(layer_types),
            head_dims=head_dims, kv_heads=kv_heads, sliding_window=window, rope=rope,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            final_logit_softcapping=None if softcap is None else float(softcap),
            hidden_size_per_layer_input=ple,
            vocab_size_per_layer_input=int(raw.get("vocab_size_per_layer_input", 262144)) if ple else 0,
            attention_k_eq_v=k_eq_v, num_kv_shared_layers=shared,
            use_double_wide_mlp=bool(raw.get("use_double_wide_mlp", False)), enable_moe_block=moe,
            num_experts=experts if moe else 0, top_k_experts=top_k if moe else 0,
            moe_intermediate_size=moe_inter if moe else 0,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)) or multimodal,
            max_position_embeddings=int(raw.get("max_position_embeddings", 131072)), eos_token_ids=eos_ids,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"), multimodal=multimodal)

    @staticmethod
    def _per_layer(raw: dict, layer_types: list[str], k_eq_v: bool, where: str, problems: list
                   ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Each layer's (head_dim, KV heads): `per_layer_config` (what save_pretrained writes:
        {layer index: overrides}) or, as transformers derives it when absent, full layers get
        `global_head_dim` and, only with attention_k_eq_v, `num_global_key_value_heads`."""
        hd, kv = int(raw["head_dim"]), int(raw["num_key_value_heads"])
        head_dims, kv_heads = [hd] * len(layer_types), [kv] * len(layer_types)
        plc = raw.get("per_layer_config")
        if plc is None:
            ghd = int(raw.get("global_head_dim", 512))
            gkv = raw.get("num_global_key_value_heads")
            for i, t in enumerate(layer_types):
                if t == FULL:
                    head_dims[i] = ghd
                    if k_eq_v and gkv is not None:
                        kv_heads[i] = int(gkv)
        else:
            if not isinstance(plc, dict):
                problems.append("per_layer_config must be an object {layer index: overrides}, "
                                f"got {type(plc).__name__}")
                return tuple(head_dims), tuple(kv_heads)
            for key, over in plc.items():
                try:
                    i = int(key)
                except ValueError:
                    i = -1
                if not 0 <= i < len(layer_types):
                    problems.append(f"per_layer_config key {key!r} is not a layer index 0..{len(layer_types) - 1}")
                    continue
                extra = sorted(set(over) - {"head_dim", "num_key_value_heads"})
                if extra:
                    problems.append(f"per_layer_config[{key!r}] overrides {extra}: only head_dim and "
                                    "num_key_value_heads can differ per layer")
                head_dims[i] = int(over.get("head_dim", hd))
                kv_heads[i] = int(over.get("num_key_value_heads", kv))
        heads = int(raw["num_attention_heads"])
        for i, (d, k) in enumerate(zip(head_dims, kv_heads)):
            if k < 1 or heads % k:
                problems.append(f"layer {i}: num_key_value_heads={k} must divide num_attention_heads={heads}")
            if d < 2 or d % 2:
                problems.append(f"layer {i}: head_dim={d} must be even (RoPE rotates pairs)")
        return tuple(head_dims), tuple(kv_heads)

    @staticmethod
    def _rope(params, layer_types: list[str], problems: list) -> dict:
        defaults = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
        params = defaults if params is None else params
        out = {}
        for t in sorted(set(layer_types)):
            p = params.get(t) if isinstance(params, dict) else None
            if not isinstance(p, dict):
                problems.append(f"rope_parameters has no entry for {t!r}")
                continue
            kind = p.get("rope_type", "default")
            if kind not in ("default", "proportional"):
                problems.append(f"rope_parameters[{t!r}].rope_type={kind!r} is not supported "
                                "(only 'default' and 'proportional')")
                continue
            if float(p.get("factor", 1.0)) != 1.0:
                problems.append(f"rope_parameters[{t!r}].factor={p['factor']!r} is not supported (only 1.0)")
                continue
            out[t] = RopeType(float(p.get("rope_theta", 10_000.0)),
                              float(p.get("partial_rotary_factor", 1.0)) if kind == "proportional" else 1.0,
                              kind == "proportional")
        return out


def kv_source_of_type(target: Gemma4Config, layer_type: str) -> int | None:
    """The target layer whose KV an assistant layer of `layer_type` reads: the last layer of
    that type that computes its own KV (None if there is none)."""
    own = [j for j in range(target.first_shared_layer) if target.layer_types[j] == layer_type]
    return own[-1] if own else None
