"""Encode+decode throughput of the host stack's quantization vs a numpy copy of the same array.

Prints one ratio per size (goal >= 0.5): ``time(copy) / time(encode + decode)`` where
encode = block exponents (with the NaN/Inf check) + quantization to big-endian int32 and
decode = dequantization of big-endian int32 sums back to float32, all on the same
``(blocks, K)`` float32 array. Run: ``python -m benchmarks.hoststack_codec``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from netagg import wire
from netagg.hoststack import quantization as qz


def _best(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(num_values: int, num_workers: int = 8, repeats: int = 7) -> dict[str, float]:
    """Seconds for copy, exponents, quantize, dequantize of ``num_values`` float32 values."""
    rng = np.random.default_rng(0)
    blocks = (rng.standard_normal((num_values // wire.K, wire.K))
              * np.exp2(rng.integers(-20, 20, (num_values // wire.K, 1)))).astype(np.float32)
    copy_out = np.empty_like(blocks)
    wire_out = np.empty(blocks.shape, qz.WIRE_DTYPE)
    float_out = np.empty_like(blocks)
    exponents = qz.block_exponents(blocks)
    result = {
        "copy": _best(lambda: np.copyto(copy_out, blocks), repeats),
        "exponents": _best(lambda: qz.block_exponents(blocks), repeats),
        "quantize": _best(lambda: qz.quantize(blocks, exponents, num_workers, out=wire_out), repeats),
        "dequantize": _best(lambda: qz.dequantize(wire_out, exponents, num_workers, out=float_out), repeats),
    }
    result["codec"] = result["exponents"] + result["quantize"] + result["dequantize"]
    result["ratio"] = result["copy"] / result["codec"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1 << 16, 1 << 20, 1 << 22, 1 << 24],
                        help="float32 values per array (default 64Ki 1Mi 4Mi 16Mi)")
    parser.add_argument("--workers", type=int, default=8)
    args = parser.parse_args()
    print(f"{'values':>10} {'copy ms':>9} {'exp ms':>8} {'quant ms':>9} {'dequant ms':>11} "
          f"{'codec GB/s':>11} {'ratio':>6}  (goal >= 0.5)")
    for size in args.sizes:
        r = measure(size, args.workers)
        print(f"{size:>10} {r['copy'] * 1e3:>9.3f} {r['exponents'] * 1e3:>8.3f} {r['quantize'] * 1e3:>9.3f} "
              f"{r['dequantize'] * 1e3:>11.3f} {size * 4 / r['codec'] / 1e9:>11.2f} {r['ratio']:>6.3f}")


if __name__ == "__main__":
    main()
