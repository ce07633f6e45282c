"""Fabric benchmark: NIXL host-memory transfer bandwidth against a plain memcpy of the same size. One run.

Prints `name: value  # target ... (ratio R)` lines (R >= 1: target met) and `# name: value` context lines.
`python benchmarks/fabric.py`: ~5 s.

Scenario: 64 MiB, host to host. NIXL: two agents in one process with the UCX backend (the preflight's transfer
loop, llmd.fabric.preflight.pair_bandwidth: registered numpy buffers, WRITE, one untimed warm-up, median of the
timed transfers; on one machine UCX moves the bytes with CMA, a single copy between address spaces). memcpy:
numpy.copyto between two 64 MiB buffers, median of as many copies. nixl_vs_memcpy = NIXL GB/s / memcpy GB/s: how
close the transfer engine comes to the copy it cannot beat.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmd.fabric.preflight import pair_bandwidth

TARGET_RATIO = 0.8


def report(name: str, value: float, target: float, higher_is_better: bool, fmt: str = "{:.2f}") -> None:
    ratio = value / target if higher_is_better else target / value
    op = ">=" if higher_is_better else "<="
    print(f"{name}: {fmt.format(value)}  # target {op} {target:g} (ratio {ratio:.2f})", flush=True)


def info(name: str, value: object) -> None:
    print(f"# {name}: {value}", flush=True)


def memcpy_gbps(nbytes: int, iterations: int) -> float:
    src = np.full(nbytes, 7, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    np.copyto(dst, src)  # touch every page once, as registration does for NIXL's buffers
    times = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--iterations", type=int, default=20)
    args = ap.parse_args()
    nbytes = args.mib << 20
    t0 = time.perf_counter()
    nixl, errors = pair_bandwidth(nbytes, args.iterations)
    if errors:
        raise SystemExit(f"NIXL transfer failed: {'; '.join(errors)}")
    mem = memcpy_gbps(nbytes, args.iterations)
    report("nixl_vs_memcpy", nixl / mem, TARGET_RATIO, higher_is_better=True)
    info("nixl_gbps", f"{nixl:.2f} (UCX WRITE, {args.mib} MiB host to host, median of {args.iterations})")
    info("memcpy_gbps", f"{mem:.2f} (numpy.copyto, {args.mib} MiB, median of {args.iterations})")
    info("total_s", f"{time.perf_counter() - t0:.1f}")


if __name__ == "__main__":
    main()
