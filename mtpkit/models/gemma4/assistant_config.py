"""The Gemma 4 assistant's configuration (model_type `gemma4_assistant`, a separate small
checkpoint that drafts for a Gemma 4 target) read from its `config.json`, and its
compatibility with the target, from the two config.json files alone.

The assistant's decoder is a Gemma 4 text config (`text_config`) whose every layer is
KV-shared: Q-only layers that read the KV of the target layer they map to (transformers
forces num_kv_shared_layers = num_hidden_layers). Omitted top-level fields take
transformers 5.24's defaults (Gemma4AssistantConfig): backbone_hidden_size 1536, no ordered
embeddings, 2048 centroids, top 32 of them.
"""

import dataclasses

from mtpkit.errors import ConfigError
from mtpkit.models.config_fields import FLAG, OBJECT, TEXT, Field, count, field_problems, raise_problems
from mtpkit.models.gemma4.config import SLIDING, Gemma4Config, kv_source_of_type


# The assistant's own config.json fields (its text_config is a Gemma 4 decoder's: FIELDS there).
FIELDS: dict[str, Field] = {
    "model_type": TEXT, "text_config": OBJECT, "tie_word_embeddings": FLAG, "backbone_hidden_size": count(),
    "use_ordered_embeddings": FLAG, "num_centroids": count(), "centroid_intermediate_top_k": count(),
    "torch_dtype": TEXT, "dtype": TEXT,
}


@dataclasses.dataclass(frozen=True)
class Gemma4AssistantConfig:
    text: Gemma4Config                     # the decoder (every layer Q-only: num_kv_shared_layers = layers)
    backbone_hidden_size: int              # the target's hidden size it was trained with
    use_ordered_embeddings: bool = False   # logits through the centroid head (token_ordering)
    num_centroids: int = 2048
    centroid_intermediate_top_k: int = 32
    torch_dtype: str | None = None
    model_type: str = "gemma4_assistant"

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.text.hidden_size

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config") -> "Gemma4AssistantConfig":
        if raw.get("model_type") != "gemma4_assistant":
            raise ConfigError(f"{where}: model_type {raw.get('model_type')!r} is not a Gemma 4 assistant "
                              "(expected 'gemma4_assistant')")
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"{where}: a Gemma 4 assistant needs a text_config object (its decoder)")
        problems = field_problems(raw, FIELDS)
        n = text.get("num_hidden_layers")
        shared = text.get("num_kv_shared_layers")
        if shared not in (None, 0, n):
            problems.append(f"text_config.num_kv_shared_layers={shared!r}: every layer of an assistant reads the "
                            f"target's KV, so it must equal num_hidden_layers={n!r} (or be omitted)")
        # transformers' own architecture checks (Gemma4AssistantConfig.validate_architecture),
        # with its class defaults for omitted fields.
        for field, default in (("hidden_size_per_layer_input", 256), ("vocab_size_per_layer_input", 262144)):
            if text.get(field, default):
                problems.append(f"text_config.{field}={text.get(field, default)!r} must be 0 "
                                "(an assistant has no per-layer embeddings)")
        for field in ("enable_moe_block", "use_double_wide_mlp"):
            if text.get(field):
                problems.append(f"text_config.{field}={text[field]!r} must be false (an assistant has dense "
                                "MLPs of one width)")
        if not raw.get("tie_word_embeddings", True):
            problems.append("tie_word_embeddings=false is not supported (the assistant's logits come from its "
                            "tied embedding table)")
        hb = raw.get("backbone_hidden_size", 1536)
        ordered = bool(raw.get("use_ordered_embeddings", False))
        centroids, top_k = raw.get("num_centroids", 2048), raw.get("centroid_intermediate_top_k", 32)
        if ordered:
            vocab = text.get("vocab_size")
            if not (isinstance(centroids, int) and centroids > 0 and isinstance(vocab, int) and vocab % centroids == 0):
                problems.append(f"num_centroids={centroids!r} must divide vocab_size={vocab!r} (use_ordered_embeddings "
                                "splits the vocabulary into equal clusters)")
            elif not (isinstance(top_k, int) and 0 < top_k <= centroids):
                problems.append(f"centroid_intermediate_top_k={top_k!r} must be in 1..num_centroids={centroids}")
        raise_problems(where, problems)
        decoder = Gemma4Config.from_dict({**text, "model_type": text.get("model_type", "gemma4_text"),
                                          "num_kv_shared_layers": 0}, where=f"{where} text_config")
        return cls(text=dataclasses.replace(decoder, num_kv_shared_layers=decoder.num_hidden_layers),
                   backbone_hidden_size=hb, use_ordered_embeddings=ordered, num_centroids=int(centroids),
                   centroid_intermediate_top_k=int(top_k),
                   torch_dtype=raw.get("torch_dtype") or raw.get("dtype") or decoder.torch_dtype)


def compatibility_problems(a: Gemma4AssistantConfig, t: Gemma4Config) -> list[str]:
    """Every way the assistant cannot read this target's KV or embeddings, one line each."""
    problems = []
    if a.backbone_hidden_size != t.hidden_size:
        problems.append(f"backbone_hidden_size={a.backbone_hidden_size} differs from the target's hidden_size="
                        f"{t.hidden_size}")
    if a.vocab_size != t.vocab_size:
        problems.append(f"vocab_size={a.vocab_size} differs from the target's {t.vocab_size}")
    seen = set()
    for i, kind in enumerate(a.text.layer_types):
        src = kv_source_of_type(t, kind)
        if src is None:
            if kind not in seen:
                problems.append(f"its {kind} layers have no target layer of that type computing KV to read")
            seen.add(kind)
            continue
        for what, mine, theirs in (("head_dim", a.text.head_dims[i], t.head_dims[src]),
                                   ("num_key_value_heads", a.text.kv_heads[i], t.kv_heads[src])):
            if mine != theirs and (kind, what) not in seen:
                problems.append(f"its {kind} layers have {what}={mine}, the target's layer {src} (whose KV they "
                                f"read) {theirs}")
                seen.add((kind, what))
    for kind in sorted(set(a.text.layer_types) & set(t.rope)):
        if a.text.rope[kind] != t.rope[kind]:
            problems.append(f"rope_parameters[{kind!r}] {a.text.rope[kind]} differs from the target's {t.rope[kind]}")
    if SLIDING in a.text.layer_types and a.text.sliding_window != t.sliding_window:
        problems.append(f"sliding_window={a.text.sliding_window} differs from the target's {t.sliding_window}")
    return problems
