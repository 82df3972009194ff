"""The model-family seam: every built-in family's model satisfies the written-down interface
(mtpkit/models/family.py), and a third family, written here from the project's layers, runs
through the unchanged engine (registry, cache groups, loader, scheduler, graphs, drafters).

`toy_llama` is a plain attention decoder: no recurrent state, RoPE, GQA, SwiGLU MLP, tied
embeddings. Its correctness oracle is `reference_logits`, a full-sequence causal attention
over the same weights with no cache at all.
"""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from mtpkit import LLM, SamplingParams
from mtpkit.step.metadata import PrefillMetadata
from mtpkit.step.cache_spec import CacheSpec, KVGroup
from mtpkit.errors import ConfigError
from mtpkit.models import registry
from mtpkit.models.family import CausalLM, FamilyConfig, FamilyModel
from mtpkit.models.gemma4.model import Gemma4ForCausalLM
from mtpkit.checkpoint.hub import checkpoint_default_drafter, read_config_json, resolve_model
from mtpkit.checkpoint.weights import CheckpointModel
from mtpkit.kernels.ops import select_ops
from mtpkit.step.cache_spec import CacheSpec as _CacheSpec
from mtpkit.layers.mlp import MLP
from mtpkit.layers.linear import Linear
from mtpkit.layers.rope import PartialRoPE
from mtpkit.layers.norm import RMSNorm
from mtpkit.checkpoint.loader import export_state_dict
from mtpkit.parallel import TP
from mtpkit.shapes import is_debug

F64 = dict(dtype="float64", device="cpu")


# ---- the family (what a new model type writes) ---------------------------------------------
@dataclasses.dataclass(frozen=True)
class ToyConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 512
    eos_token_ids: tuple = ()
    torch_dtype: str | None = None

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config"):
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names})


class ToyAttention(nn.Module):
    def __init__(self, cfg: ToyConfig, index: int, ops):
        super().__init__()
        self.index, self.ops, self.h, self.kvh, self.d = index, ops, cfg.num_attention_heads, \
            cfg.num_key_value_heads, cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, (self.h + 2 * self.kvh) * self.d)
        self.o_proj = Linear(self.h * self.d, cfg.hidden_size)
        self.rope = PartialRoPE(self.d, self.d, cfg.rope_theta)

    def forward(self, x, positions, meta, cache):
        h, kvh, d = self.h, self.kvh, self.d
        qkv = self.qkv_proj(x).view(-1, h + 2 * kvh, d)
        qk, v = self.rope(positions, qkv[:, :h + kvh]), qkv[:, h + kvh:]
        k_cache, v_cache = cache.kv["attention"][self.index]
        pool = cache.pool_index["attention"]
        self.ops.write_kv(qk[:, h:], v, k_cache, v_cache, meta.slot_mappings[pool])
        q = qk[:, :h]
        if isinstance(meta, PrefillMetadata):
            o = self.ops.paged_attention_prefill(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens,
                                                 meta.block_tables[pool], d ** -0.5)
        else:
            o = self.ops.paged_attention_verify(q.reshape(meta.num_reqs_padded, meta.q_len, h, d), k_cache, v_cache,
                                                meta.seq_lens, meta.block_tables[pool], d ** -0.5,
                                                max_seq_len=meta.max_seq_len,
                                                kv_slots=None if meta.kv_slots is None else meta.kv_slots[pool])
        return self.o_proj(o.reshape(-1, h * d))

    def reference(self, x):
        """Causal attention over the whole sequence, no cache."""
        h, kvh, d = self.h, self.kvh, self.d
        qkv = self.qkv_proj(x).view(-1, h + 2 * kvh, d)
        qk = self.rope(torch.arange(x.shape[0]), qkv[:, :h + kvh])
        q, k, v = qk[:, :h], qk[:, h:].repeat_interleave(h // kvh, 1), qkv[:, h + kvh:].repeat_interleave(h // kvh, 1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        return self.o_proj(o.transpose(0, 1).reshape(-1, h * d))


class ToyLlama(FamilyModel):
    def __init__(self, cfg: ToyConfig, ops, tp: TP | None = None):
        super().__init__()
        self.cfg, self.ops, self.tp = cfg, ops, tp or TP.single()
        H = cfg.hidden_size
        self.embed_tokens = nn.Parameter(torch.empty(cfg.vocab_size, H), requires_grad=False)
        self.lm_head = None
        self.attn = nn.ModuleList([ToyAttention(cfg, i, ops) for i in range(cfg.num_hidden_layers)])
        self.mlp = nn.ModuleList([MLP(H, cfg.intermediate_size, self.tp) for _ in range(cfg.num_hidden_layers)])
        self.norms = nn.ModuleList([RMSNorm(H, cfg.rms_norm_eps) for _ in range(2 * cfg.num_hidden_layers + 1)])

    @staticmethod
    def cache_spec(cfg: ToyConfig, *, num_spec: int, tp_size: int = 1) -> CacheSpec:
        return CacheSpec(kv=(KVGroup("attention", cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim),))

    @staticmethod
    def check_tensor_parallel(cfg: ToyConfig, size: int) -> None:
        if size > 1:
            raise ConfigError("toy_llama runs on one rank")

    @staticmethod
    def checkpoint_name(name: str) -> str:
        return "model." + name

    def set_weight_layout(self, device):   # the layout it was tested with (FamilyModel's is column-major on CPU)
        pass

    def _layers(self, x, attend):
        for i, (attn, mlp) in enumerate(zip(self.attn, self.mlp)):
            x = x + attend(attn, self.norms[2 * i](x))
            x = x + mlp(self.norms[2 * i + 1](x))
        return self.norms[-1](x)

    def forward(self, token_ids, positions, meta, cache):
        return self._layers(self.embed_tokens[token_ids], lambda attn, h: attn(h, positions, meta, cache))

    def compute_logits(self, hidden):
        return hidden @ self.embed_tokens.t()

    def reference_logits(self, ids: list[int]):
        return self.compute_logits(self._layers(self.embed_tokens[torch.tensor(ids)], lambda attn, h: attn.reference(h)))


# ---- the interface (family.py) -------------------------------------------------------------
def _built(name: str):
    """(family, config, model) of an embedded checkpoint, built from config.json (random weights)."""
    family, cfg = registry.read_config(resolve_model(name))
    return family, cfg, family.model_class(cfg, select_ops(torch.device("cpu")), TP.single())


@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-gemma4"])
def test_builtin_families_satisfy_the_interface(name):
    """Each built-in family's config and model are what the engine, the loader and the
    drafters call: the Protocols of family.py, the optional hooks from FamilyModel, the
    class-level declarations callable from config.json alone."""
    family, cfg, model = _built(name)
    assert isinstance(cfg, FamilyConfig)
    assert issubclass(family.model_class, FamilyModel)
    assert isinstance(model, CausalLM) and isinstance(model, CheckpointModel)
    assert isinstance(family.model_class.cache_spec(cfg, num_spec=2, tp_size=1), _CacheSpec)
    assert family.model_class.check_tensor_parallel(cfg, 1) is None
    assert isinstance(model.checkpoint_aliases({}), dict)
    assert isinstance(model.ignored_checkpoint_prefixes(), tuple)


def test_the_drafter_kind_is_a_checkpoint_model():
    """The Gemma 4 assistant (a drafter kind, declared in the registry) is filled by the same
    loader: a CheckpointModel, built from the target's declared KV sources."""
    target_path = resolve_model("tiny-gemma4")
    raw = read_config_json(resolve_model(checkpoint_default_drafter(target_path)))
    kind = registry.drafter_kind_of(raw)
    assert kind is not None and kind.reads_target_kv
    _, target_cfg, target = _built("tiny-gemma4")
    sources = target.kv_sources()
    for layer_type, at in sources.items():        # the last KV-computing layer of each type
        last = max(i for i in range(target_cfg.first_shared_layer) if target_cfg.layer_types[i] == layer_type)
        attn = target.layers[last].self_attn
        assert at == (attn.kv_group, attn.kv_index)
    assistant = kind.model_class(kind.config_class.from_dict(raw), select_ops(torch.device("cpu")), TP.single(),
                                 kv_at=sources)
    assert issubclass(kind.model_class, FamilyModel) and isinstance(assistant, CheckpointModel)
    assert registry.drafter_kind_of({**raw, "model_type": "gemma4_text"}) is None


def test_the_interface_check_fails_on_a_missing_member(monkeypatch):
    """The checks above are not vacuous: a family model missing a method, an attribute or a
    FamilyModel default does not satisfy the Protocols."""
    _, _, model = _built("tiny-gemma4")
    assert isinstance(model, CausalLM)
    with monkeypatch.context() as m:
        m.delattr(Gemma4ForCausalLM, "compute_logits")
        assert not isinstance(model, CausalLM)
    with monkeypatch.context() as m:
        m.delattr(FamilyModel, "checkpoint_aliases")        # a hook only the base class provides
        assert not isinstance(model, CheckpointModel) and not isinstance(model, CausalLM)
    with monkeypatch.context() as m:
        m.delattr(model, "ops")
        assert not isinstance(model, CausalLM)
    assert isinstance(model, CausalLM)


TOY = dict(model_type="toy_llama", vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=8, intermediate_size=48)


def _checkpoint(path, seed: int, **overrides):
    """config.json + model.safetensors with random weights large enough that greedy decoding
    has no near-ties (std 0.02 weights give near-uniform logits)."""
    raw = {**TOY, **overrides}
    model = ToyLlama(ToyConfig.from_dict(raw), ops=None)
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.data = torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3
    path.mkdir()
    (path / "config.json").write_text(json.dumps(raw))
    save_file({k: v.contiguous() for k, v in export_state_dict(model).items()}, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    registry.register_family(registry.ModelFamily("toy_llama", ToyConfig, ToyLlama))
    root = tmp_path_factory.mktemp("toy")
    yield {"target": _checkpoint(root / "target", 0), "other": _checkpoint(root / "other", 1, num_hidden_layers=1)}
    registry.FAMILIES.pop("toy_llama")


PROMPTS = [[5, 17, 3], list(range(1, 30)), [44] * 9, [7, 8, 9, 10, 11, 12], [90, 2]]


def _reference_greedy(path, prompts, n):
    llm = LLM(path, **F64)          # only for its loaded model
    out = []
    for p in prompts:
        ids = list(p)
        with torch.no_grad():
            for _ in range(n):
                ids.append(int(llm.model.reference_logits(ids)[-1].argmax()))
        out.append(ids[len(p):])
    return out


def _run(path, trace: bool, **kw):
    llm = LLM(path, max_num_seqs=2, max_num_batched_tokens=8, **F64, **kw)   # 5 prompts, chunks of <= 8
    if llm.runner.graphs is not None and trace:
        llm.runner.graphs.trace_after = 0
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
    return [o.token_ids for o in outs], llm


@pytest.fixture(scope="module")
def expected(toy):
    return _reference_greedy(toy["target"], PROMPTS, 24)


@pytest.mark.parametrize("mode", ["eager", "graphs"])
def test_third_family_runs_through_the_engine(toy, expected, mode):
    """Continuous batching (5 prompts, 2 at a time), chunked prefill (8-token chunks) and the
    graph path or eager: the greedy tokens of a full-sequence reference with no cache."""
    tokens, llm = _run(toy["target"], trace=True, enforce_eager=mode == "eager")
    assert tokens == expected
    assert llm.slots.stateless and llm.cache.state == {}
    if mode == "graphs" and not is_debug():   # debug mode calls the graph bodies directly
        assert llm.runner.graphs.verify_graphs, "the decode steps were meant to run as traced graphs"


@pytest.mark.parametrize("draft,mode", [("target", "graphs"), ("target", "eager"), ("other", "graphs")])
def test_separate_draft_model_is_lossless(toy, expected, draft, mode):
    """A second instance of the family drafts num_spec=2 tokens with its own paged KV: the
    output equals generation without it. Drafting with the target's own weights accepts
    almost everything (so full and partial acceptances both happen); a different model
    mostly gets rejected."""
    tokens, llm = _run(toy["target"], trace=True, enforce_eager=mode == "eager", num_spec=2,
                       draft_model=toy[draft])
    assert tokens == expected
    assert set(llm.cache.kv) == {"attention", "draft.attention"}
    rate = llm.stats.acceptance_rate
    assert (rate > 0.9) if draft == "target" else (rate < 0.6)
    assert llm.stats.num_accepted > 0
    if mode == "graphs" and not is_debug():
        assert llm.runner.graphs.propose_graphs


def test_draft_model_kv_is_budgeted_and_reserved(toy):
    """The drafter's KV group is allocated in the same block pool and counted by the budget;
    its passes reach num_spec positions past the verify step, so the engine reserves for them."""
    llm = LLM(toy["target"], num_spec=3, draft_model=toy["other"], kv_cache_memory=1 << 20, **F64)
    kv = [t for layers in llm.cache.kv.values() for pair in layers for t in pair]
    assert len(kv) == 2 * (TOY["num_hidden_layers"] + 1)
    assert (1 << 20) - sum(t.nbytes for t in kv) // llm.kv_pool_sizes["full"] < sum(t.nbytes for t in kv) <= 1 << 20
    assert llm.engine_config.kv_lookahead == 3
    assert llm.engine_config.max_positions == llm.engine_config.max_model_len + 3 + 3


def test_registry_and_drafter_errors(toy, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**TOY, "model_type": "nonesuch"}))
    with pytest.raises(ConfigError, match="nonesuch.*supported model types: .*qwen3_next.*toy_llama"):
        LLM(bad)
    with pytest.raises(ConfigError, match="has no built-in one; pass draft_model="):
        LLM(toy["target"], num_spec=2)
    with pytest.raises(ConfigError, match="vocab_size 64 differs"):
        LLM(toy["target"], num_spec=2, draft_model=_checkpoint(tmp_path / "v64", 0, vocab_size=64))
    with pytest.raises(ConfigError, match="keeps recurrent state"):
        LLM(toy["target"], num_spec=2, draft_model="tiny-qwen3-next")
    with pytest.raises(ConfigError, match="num_spec=0"):
        LLM(toy["target"], draft_model=toy["other"])


def test_cli_passes_the_draft_model(capsys):
    """--draft-model reaches LLM (here: refused from config.json alone, before any weight)."""
    from mtpkit import cli
    assert cli.main(["generate", "x", "--draft-model", "tiny-qwen3-next", "--num-spec", "2"]) == 2
    assert "keeps recurrent state" in capsys.readouterr().err
