"""KV-cache bytes per request of Gemma 4 31B and 26B-A4B at 4k, 32k and 128k context, with
and without sliding-window block recycling (engine/kv_pools.py).

The numbers are the sizes of the tensors the engine allocates: the model's cache spec from its
config.json (tests/gemma4_shapes.py: real layer counts and widths), the pools sized as LLM sizes
them (`pool_sizing.kv_pool_sizes`, max_model_len = the context), allocated by `allocate_cache` on the
meta device (shapes only: no memory is touched, so the real layer counts fit anywhere). bf16,
blocks of 16 tokens, no drafter (num_spec 0) and with the Gemma 4 assistant's read-back.

Two figures per row:
- one request: the pools allocated for max_num_seqs=1 (the null block, and a sliding pool's
  room for a whole prefill chunk of max_num_batched_tokens=2048 tokens, included);
- each further request: what raising max_num_seqs by one adds (its window, the next verify
  step and the read-back: the steady state of a long generation).

    python benchmarks/memory_gemma4.py
"""

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import gemma4_shapes  # noqa: E402

from mtpkit.config import EngineConfig  # noqa: E402
from mtpkit.step.cache import allocate_cache  # noqa: E402
from mtpkit.engine.pool_sizing import kv_pool_sizes  # noqa: E402
from mtpkit.models.gemma4.model import Gemma4ForCausalLM  # noqa: E402
from mtpkit.models.gemma4.config import Gemma4Config  # noqa: E402

CONTEXTS = (4096, 32768, 131072)


def kv_bytes(raw: dict, *, context: int, recycle: bool, max_num_seqs: int = 1, num_spec: int = 0,
             kv_read_back: int = 0, block_size: int = 16, max_num_batched_tokens: int = 2048,
             dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
    """Bytes of every KV pool's tensors as the engine allocates them (meta device), by pool."""
    cfg = Gemma4Config.from_dict(raw)
    spec = Gemma4ForCausalLM.cache_spec(cfg, num_spec=num_spec)
    ecfg = EngineConfig(num_spec=num_spec, kv_read_back=kv_read_back, max_num_seqs=max_num_seqs,
                        max_model_len=context, block_size=block_size, max_num_batched_tokens=max_num_batched_tokens)
    sizes = kv_pool_sizes(spec, ecfg, full_blocks=1 + max_num_seqs * ecfg.max_blocks, recycle=recycle)
    cache = allocate_cache(spec, num_blocks=sizes, num_slots=0, block_size=block_size, dtype=dtype,
                           device=torch.device("meta"))
    out = {p.name: 0 for p in spec.pools}
    for g in spec.kv:
        out[g.pool] += sum(t.nbytes for kv in cache.kv[g.name] for t in kv)
    return out


def _gib(n: float) -> str:
    return f"{n / (1 << 30):8.2f} GiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", nargs="+", default=["31B", "26B-A4B"])
    ap.add_argument("--num-spec", type=int, default=0, help="verify bundle num_spec + 1 (the assistant reads back 2)")
    args = ap.parse_args()
    read_back = 2 if args.num_spec else 0
    print("Gemma 4 KV cache per request, bf16, 16-token blocks, allocated on the meta device at the real layer "
          f"counts (tests/gemma4_shapes.py; some sizes there are assumptions), num_spec={args.num_spec}"
          + (", assistant read-back 2" if read_back else ""))
    for name in args.variants:
        raw = gemma4_shapes.REAL[name]
        print(f"\n{name}: {raw['num_hidden_layers']} layers, sliding window {raw['sliding_window']}")
        print(f"{'context':>8}  {'recycling':>9}  {'one request':>12}  {'of it sliding':>13}  "
              f"{'each further':>12}  {'of it sliding':>13}")
        for context in CONTEXTS:
            rows = {}
            for recycle in (False, True):
                kw = dict(context=context, recycle=recycle, num_spec=args.num_spec, kv_read_back=read_back)
                one, two = kv_bytes(raw, **kw), kv_bytes(raw, max_num_seqs=2, **kw)
                more = {k: two[k] - one[k] for k in one}
                slide = [k for k in one if k != "full"]
                rows[recycle] = sum(one.values())
                print(f"{context:>8}  {'on' if recycle else 'off':>9}  {_gib(sum(one.values()))}  "
                      f"{_gib(sum(one[k] for k in slide))}  {_gib(sum(more.values()))}  "
                      f"{_gib(sum(more[k] for k in slide))}")
            print(f"{'':>8}  {'ratio':>9}  {rows[False] / rows[True]:11.2f}x")


if __name__ == "__main__":
    main()
