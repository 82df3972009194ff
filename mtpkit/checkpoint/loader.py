"""Load a Hugging Face checkpoint (model.safetensors, or a sharded index) into a model of any
family, by the checkpoint's own names: each parameter's `WeightSpec` comes from the module
that owns it (`checkpoint_specs`) or, for a plain parameter, from the model's
`checkpoint_name`. What it calls on a model and its modules: weights.py's `CheckpointModel`,
`HasCheckpointSpecs` and `KeepsFP8`.

Every check runs on the safetensors headers first (names and shapes, no data read), and every
missing, unexpected or misshapen weight is reported in one `CheckpointError` (every rank checks
the whole checkpoint, so all ranks agree on it). Each tensor-parallel rank then reads only the
slices its parameters hold: tensors are opened lazily (`Stored`) and read by `.narrow`.
"""

import json
from pathlib import Path
import torch
from safetensors import safe_open

from mtpkit.errors import CheckpointError
from mtpkit.checkpoint.fp8 import FP8_HEADER, Dequantized, FP8Format, pair_scales
from mtpkit.checkpoint.weights import CheckpointModel, HasCheckpointSpecs, KeepsFP8, WeightSpec, read


class Stored:
    """A checkpoint tensor not read yet. `.narrow` reads just that slice from the file (what a
    tensor-parallel rank needs); `.read()` the whole tensor."""

    def __init__(self, sl):
        self._sl, self.shape = sl, torch.Size(sl.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        idx = [slice(None)] * len(self.shape)
        idx[dim] = slice(start, start + length)
        return self._sl[tuple(idx)]

    def read(self) -> torch.Tensor:
        return self._sl[:]


def _open(f: Path):
    """safe_open, with an unreadable file (empty, truncated, not safetensors) reported as a
    CheckpointError naming it instead of safetensors' bare error without the path."""
    try:
        return safe_open(f, "pt")
    except Exception as e:  # SafetensorError (not importable by a stable name), OSError
        size = f.stat().st_size if f.exists() else None
        raise CheckpointError(
            f"{f} is truncated or corrupt ({'empty' if size == 0 else f'{size} bytes'}; safetensors: {e}); "
            "copy or download it again") from e


def checkpoint_index(path: Path) -> dict[str, Path]:
    """checkpoint tensor name -> safetensors file holding it."""
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / fname for name, fname in weight_map.items()}
    if single.exists():
        with _open(single) as f:
            return {name: single for name in f.keys()}
    raise CheckpointError(f"{path} holds neither model.safetensors nor model.safetensors.index.json")


def _shapes(index: dict[str, Path], dtypes: dict | None = None) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape from the headers (and, into `dtypes`, its header dtype name)."""
    shapes, by_file = {}, {}
    for name, f in index.items():
        by_file.setdefault(f, []).append(name)
    for f, names in by_file.items():
        if not f.exists():
            raise CheckpointError(f"the index names {f.name}, which is not in the checkpoint directory")
        with _open(f) as fh:
            present = set(fh.keys())
            for n in names:
                if n not in present:
                    raise CheckpointError(f"the index maps {n} to {f.name}, which does not contain it")
                sl = fh.get_slice(n)
                shapes[n] = tuple(sl.get_shape())
                if dtypes is not None:
                    dtypes[n] = sl.get_dtype()
    return shapes


def weight_specs(model: CheckpointModel) -> list[WeightSpec]:
    """Every parameter with the checkpoint tensors it is made from (see weights.py). The model
    provides `embed_tokens` and `lm_head` (None when tied; both vocab-parallel) and
    `checkpoint_name(parameter name)`; modules with merged or sharded layouts provide
    `checkpoint_specs(checkpoint prefix)`; every other parameter is replicated as stored."""
    tp, V = model.tp, model.cfg.vocab_size
    specs: list[WeightSpec] = []

    def simple(p, name, shape, assemble=read):
        specs.append(WeightSpec(p, {name: shape}, lambda t: assemble(t[name]), lambda w: {name: w}))

    # Vocab-parallel: rank r holds rows r*ceil(V/size) ... (zero-padded past V).
    for pname, p in (("embed_tokens", model.embed_tokens), ("lm_head", model.lm_head)):
        if p is not None:
            simple(p, model.checkpoint_name(pname + ".weight"), (V, p.shape[1]), lambda x: tp.shard_padded(x, 0))
    owned = {id(model.embed_tokens), id(model.lm_head)}
    for mname, m in model.named_modules():
        if mname and isinstance(m, HasCheckpointSpecs):  # linear family, MoE, ...: their own layouts
            for spec in m.checkpoint_specs(model.checkpoint_name(mname)):
                specs.append(spec)
                owned.add(id(spec.param))
    for pname, p in model.named_parameters():
        if id(p) not in owned:  # norms and the like: replicated, same shape everywhere
            simple(p, model.checkpoint_name(pname), tuple(p.shape))
    return specs


def export_state_dict(model: CheckpointModel) -> dict[str, torch.Tensor]:
    """The model's parameters under the checkpoint's names and shapes (the inverse of loading;
    single rank)."""
    if model.tp.size != 1:
        raise ValueError("export_state_dict needs the whole model: tensor_parallel_size must be 1")
    out: dict[str, torch.Tensor] = {}
    for spec in weight_specs(model):
        for name, t in spec.export(spec.param).items():
            assert name not in out, name
            out[name] = t
    return out


def checkpoint_fp8(path: Path) -> FP8Format | None:
    """The checkpoint's FP8 format (config.json quantization_config), None if unquantized."""
    f = path / "config.json"
    return FP8Format.from_config(json.loads(f.read_text()), str(f)) if f.exists() else None


def fp8_weights(path: Path) -> tuple[FP8Format, dict[str, str]] | None:
    """(format, FP8 weight name -> scale name) of an FP8 checkpoint, from config.json and the
    headers alone; None when it is not quantized."""
    fmt = checkpoint_fp8(path)
    if fmt is None:
        return None
    dtypes: dict[str, str] = {}
    shapes = _shapes(checkpoint_index(path), dtypes)
    return fmt, pair_scales(fmt, shapes, dtypes, str(path))


def keep_fp8_linears(model: CheckpointModel, fmt: FP8Format, fp8_weights) -> list[str]:
    """Switch every module that holds a checkpoint FP8 weight (the linear family, merged ones
    included, and the MoE blocks) to FP8 mode: each keeps its FP8 weights with their block
    scales, whatever its merges and shards (layers/fp8_layout.py), and runs the FP8 matmuls of
    the model's kernel selector (`model.ops`, kernels/ops.py). Tensors kept unquantized in
    the file (modules_to_not_convert) stay in the model dtype. Checkpoints with one scale per
    tensor (weight_block_size null) are dequantized. Returns the modules switched."""
    kept = []
    if fmt.block is None:
        return kept
    for mname, m in list(model.named_modules()):
        if mname and isinstance(m, KeepsFP8) and m.use_fp8(fmt.block, model.checkpoint_name(mname), fp8_weights,
                                                           model.ops):
            kept.append(mname)
    return kept


def load_checkpoint(model: CheckpointModel, path: str | Path, dtype: torch.dtype,
                    device: torch.device, keep_fp8: bool | None = None) -> None:
    """Check every name and shape, then load every parameter as `dtype` on `device`.

    FP8 checkpoints: `keep_fp8` (default: on CUDA) keeps every FP8 weight with its block
    scales and runs the block-scaled FP8 matmul (keep_fp8_linears); with it off (the default
    elsewhere) every FP8 tensor is dequantized to `dtype` here."""
    path = Path(path)
    index = checkpoint_index(path)
    dtypes: dict[str, str] = {}
    shapes = _shapes(index, dtypes)
    fmt = checkpoint_fp8(path)
    if fmt is None and FP8_HEADER in dtypes.values():
        raise CheckpointError(f"checkpoint {path} holds float8_e4m3fn tensors but its config.json has no "
                              "quantization_config (quant_method 'fp8', weight_block_size); add it")
    fp8_pairs = pair_scales(fmt, shapes, dtypes, str(path)) if fmt else {}
    if fp8_pairs and (device.type == "cuda" if keep_fp8 is None else keep_fp8):
        keep_fp8_linears(model, fmt, fp8_pairs)
    # Other layouts of the same tensors a model can read (e.g. fused experts): name -> (stored, cut).
    aliases = model.checkpoint_aliases(shapes)
    specs = weight_specs(model)
    expected = {n: s for spec in specs for n, s in spec.sources.items()}

    def found_shape(n):
        if n in shapes:
            return shapes[n]
        src, fn = aliases[n]
        return tuple(fn(torch.empty(shapes[src], device="meta")).shape)

    used_fused = {aliases[n][0] for n in expected if n not in shapes and n in aliases}
    missing = [n for n in expected if n not in shapes and n not in aliases]
    misshapen = [(n, expected[n], found_shape(n)) for n in expected
                 if n not in missing and found_shape(n) != tuple(expected[n])]
    ignorable = model.ignored_checkpoint_prefixes()
    scales = set(fp8_pairs.values())  # read with their weights (expected by name only in FP8 mode)
    unexpected = [n for n in shapes if n not in expected and n not in used_fused and n not in scales
                  and not n.startswith(ignorable)]
    if missing or misshapen or unexpected:
        lines = [f"checkpoint {path} does not match the model config:"]
        lines += [f"  missing: {n} (expected shape {list(expected[n])})" for n in missing]
        lines += [f"  misshapen: {n} expected {list(e)} found {list(f)}" for n, e, f in misshapen]
        lines += [f"  unexpected: {n} (shape {list(shapes[n])})" for n in unexpected]
        raise CheckpointError("\n".join(lines))

    handles: dict[Path, object] = {}
    cache: dict[str, torch.Tensor] = {}

    def stored(n):
        f = index[n]
        if f not in handles:
            handles[f] = _open(f)
        return Stored(handles[f].get_slice(n))

    def load(n, raw=False):  # nothing is read from the file until a spec narrows or reads it
        if n in fp8_pairs and not raw:
            return Dequantized(stored(n), stored(fp8_pairs[n]), fmt.block)
        if n in shapes:
            return stored(n)
        src, fn = aliases[n]
        if src not in cache:
            cache[src] = read(load(src))
        return fn(cache[src])

    bad = []
    with torch.no_grad():
        for spec in specs:
            # A spec that names a weight's scale reads the raw FP8 pair (a layer in FP8 mode).
            value = read(spec.assemble({n: load(n, raw=fmt is not None and fmt.scale_name(n) in spec.sources)
                                        for n in spec.sources}))
            spec.param.data = value.to(dtype=None if spec.keep_dtype else dtype, device=device).contiguous()
            if (n := non_finite_count(spec.param.data)):
                bad.append(f"  {', '.join(spec.sources)}: {n} of {spec.param.numel()} values are NaN or inf")
    handles.clear()
    if bad:
        raise CheckpointError(f"checkpoint {path} holds non-finite weights (corrupted data?); no output could be "
                              f"trusted: re-download or re-save these tensors:\n" + "\n".join(bad[:20])
                              + (f"\n  ... and {len(bad) - 20} more" if len(bad) > 20 else ""))
    for buf in model.buffers():  # RoPE frequencies stay fp32
        buf.data = buf.data.to(device)


def non_finite_count(t: torch.Tensor) -> int:   # plain Tensor: any weight of any shape and dtype
    """NaN / inf values of a loaded weight (FP8 e4m3fn has NaN only: every exponent and mantissa
    bit set). One pass over the weights: benchmarks/load_check.py measures its cost at load."""
    if t.dtype == torch.float8_e4m3fn:
        return int(((t.view(torch.uint8) & 0x7F) == 0x7F).sum())
    if not t.is_floating_point() or t.numel() == 0:
        return 0
    # aminmax propagates NaN and shows +-inf: one pass without a mask (~60x faster than
    # isfinite over bf16 on CPU); the count only when something is wrong.
    if all(torch.isfinite(x) for x in torch.aminmax(t)):
        return 0
    return int((~torch.isfinite(t)).sum())


def build_model(family, cfg, path: Path, *, ops, tp, dtype: torch.dtype, device: torch.device,
                load_format: str, seed: int, keep_fp8: bool | None = None, **kwargs) -> CheckpointModel:
    """A model of `family` (a family or drafter-kind record: `family.model_class(cfg, ops, tp,
    **kwargs)`) with its weights: read from the checkpoint at `path` (FP8 weights kept as
    load_checkpoint's `keep_fp8` says), or random (`load_format="dummy"`, deterministic in
    `seed`); then laid out for the device."""
    from mtpkit.checkpoint.dummy import init_dummy_weights
    model = family.model_class(cfg, ops, tp, **kwargs)
    if load_format == "dummy":
        init_dummy_weights(model, dtype, device, seed)
    else:
        load_checkpoint(model, path, dtype, device, keep_fp8=keep_fp8)
    model.set_weight_layout(device)
    return model
