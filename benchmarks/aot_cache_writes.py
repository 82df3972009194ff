"""Why a compiled proposal's time grows with the KV pool (issue 32): an AOTInductor graph that
writes the same cache argument more than once, with reads in between (a drafter's one-token
passes each write their K/V and attend over it), copies the whole cache tensor, where a graph
writing it once (a verify step) updates it in place.

Each case exports and compiles (AOTInductor, the "aot" mode's path) a body that writes rows of
a K and a V cache (`index_copy_`, as the decode steps' `write_kv` does) `writes`
times, gathering 128 rows after each write, for a pool of 130 blocks (1 MB per tensor, the
embedded model's default) and 4096 blocks (32 MB), and prints us per replay and their ratio: a
ratio near 1 is an in-place write, near the size ratio (32) a copy of the pool per replay.

    python benchmarks/aot_cache_writes.py
"""

import tempfile
import time
from pathlib import Path

import torch


H, D, BS = 2, 64, 16


class Body(torch.nn.Module):
    def __init__(self, writes: int):
        super().__init__()
        self.writes = writes

    def forward(self, kc, vc, slots, x, ctx):
        out = x.new_zeros(())
        for j in range(self.writes):
            for c in (kc, vc):
                c.view(-1, H, D).index_copy_(0, slots + j, x)
            k, v = kc.view(-1, H, D).index_select(0, ctx), vc.view(-1, H, D).index_select(0, ctx)
            out = out + (k * v).sum()
            x = x + 1
        return out


def replay_us(writes: int, blocks: int, tmp: Path) -> float:
    kc, vc = torch.zeros(blocks, BS, H, D), torch.zeros(blocks, BS, H, D)
    args = (kc, vc, torch.tensor([3, 4, 5, 6]), torch.randn(4, H, D), torch.arange(128))
    with torch.inference_mode():
        ep = torch.export.export(Body(writes), args, strict=False)
        path = tmp / f"w{writes}_{blocks}.pt2"
        torch._inductor.aoti_compile_and_package(ep, package_path=str(path))
        run = torch._inductor.aoti_load_package(str(path))
        eager = [kc.clone(), vc.clone()]
        Body(writes)(*eager, *args[2:])
        run(*args)
        assert torch.equal(kc, eager[0]) and torch.equal(vc, eager[1]), "the compiled writes differ from eager"
        for _ in range(5):
            run(*args)
        t = time.perf_counter()
        for _ in range(50):
            run(*args)
        return (time.perf_counter() - t) / 50 * 1e6


def main() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        for writes in (1, 3):
            small, big = replay_us(writes, 130, Path(tmp)), replay_us(writes, 4096, Path(tmp))
            print(f"{writes} write(s) of each cache per replay: 1 MB pool {small:9.1f} us, 32 MB pool {big:9.1f} us, "
                  f"x{big / small:.1f} ({'a copy of the pool per replay' if big / small > 4 else 'in place'})",
                  flush=True)


if __name__ == "__main__":
    main()
