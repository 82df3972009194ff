"""The GDN layer's causal depthwise conv + silu on a prefill (kernels/conv.py): the windows'
product and sum (`_conv_silu`, four ops, what the captured verify step keeps) against W shifted
multiply-adds (`_conv_silu_taps`, what causal_conv1d_prefill runs), at the embedded model's conv
width (384 channels, 4 taps) and a few token counts; float32 and float64 (the reference dtype),
one thread, the two interleaved in rounds; d: the largest difference.

    python benchmarks/conv_prefill.py
"""

import statistics
import time

import torch

from mtpkit.kernels.conv import _conv_silu, _conv_silu_taps


def main(rounds: int = 7, reps: int = 50):
    torch.set_num_threads(1)
    for T in (1, 4, 16, 64, 256, 1024):
        for dtype in (torch.float32, torch.float64):
            seq, w = torch.randn(1, 384, T + 3, dtype=dtype), torch.randn(384, 4)
            ts = {"windows": [], "taps": []}
            for _ in range(rounds):
                for name, fn in (("windows", _conv_silu), ("taps", _conv_silu_taps)):
                    t = time.perf_counter()
                    for _ in range(reps):
                        fn(seq, w)
                    ts[name].append((time.perf_counter() - t) / reps * 1e6)
            d = (_conv_silu(seq, w) - _conv_silu_taps(seq, w)).abs().max().item()
            r = statistics.median(a / b for a, b in zip(ts["taps"], ts["windows"]))
            print(f"T={T:5d} {str(dtype)[6:]:8s} windows {statistics.median(ts['windows']):8.1f} us  "
                  f"taps {statistics.median(ts['taps']):8.1f} us  taps/windows x{r:.2f}  d={d:.0e}")


if __name__ == "__main__":
    main()
