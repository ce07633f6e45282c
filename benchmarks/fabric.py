"""Fabric benchmark: NIXL host-memory transfer bandwidth against a plain memcpy of the same size. One run.

Prints `name: value  # target ... (ratio R)` lines (R >= 1: target met) and `# name: value` context lines.
`python benchmarks/fabric.py`: ~5 s.

Scenario: 64 MiB, host to host. NIXL: two agents in one process with the UCX backend (the preflight's transfer
loop, llmd.fabric.preflight.pair_bandwidth: registered numpy buffers, WRITE, one untimed warm-up, median of the
timed transfers; UCX picks cma/memory zero-copy for the put, as UCX_PROTO_INFO=y shows: one kernel copy). The
headline runs the agents without UCX progress threads, the waiting thread driving both (one process can do that):
each progress thread busy-polls, and on a 2-core machine two of them measure core contention rather than the
transfer; the figure with the threads on (as the preflight, across processes, must run) follows as context.
memcpy: numpy.copyto between two 64 MiB buffers, as many copies as transfers, half before and half after them, with
no NIXL agent alive; median. nixl_vs_memcpy = NIXL GB/s / memcpy GB/s: how close the transfer engine comes to the
copy it cannot beat. A loaded machine moves the ratio either way: run it on a quiet one.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _report import info, report

from llmd.fabric.preflight import pair_bandwidth

TARGET_RATIO = 0.8


class Memcpy:
    """numpy.copyto between two buffers of `nbytes`, timed once per call."""

    def __init__(self, nbytes: int) -> None:
        self.src = np.full(nbytes, 7, dtype=np.uint8)
        self.dst = np.zeros(nbytes, dtype=np.uint8)
        np.copyto(self.dst, self.src)  # touch every page once, as the NIXL warm-up transfer does for its buffers
        self.times: list[float] = []

    def __call__(self) -> None:
        t0 = time.perf_counter()
        np.copyto(self.dst, self.src)
        self.times.append(time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--iterations", type=int, default=20)
    args = ap.parse_args()
    nbytes = args.mib << 20
    if importlib.util.find_spec("nixl") is None:
        # `make bench` runs on the light install; NIXL comes with the fabric extra.
        info("nixl_vs_memcpy", "skipped: nixl is not installed (pip install -e '.[fabric]')")
        return
    t0 = time.perf_counter()
    memcpy = Memcpy(nbytes)
    # Copies before and after the transfers, with no NIXL agent alive (their progress threads would slow the copy
    # and flatter the ratio); the median over both halves evens out a machine whose load changes meanwhile.
    for _ in range(args.iterations // 2):
        memcpy()
    nixl, errors = pair_bandwidth(nbytes, args.iterations, progress_thread=False)
    threaded, more = pair_bandwidth(nbytes, args.iterations, progress_thread=True)
    for _ in range(args.iterations - args.iterations // 2):
        memcpy()
    if errors or more:
        raise SystemExit(f"NIXL transfer failed: {'; '.join(errors + more)}")
    mem = nbytes / statistics.median(memcpy.times) / 1e9
    report("nixl_vs_memcpy", nixl / mem, TARGET_RATIO, higher_is_better=True)
    info("nixl_gbps", f"{nixl:.2f} (UCX WRITE, {args.mib} MiB host to host, median of {args.iterations})")
    info(
        "nixl_gbps_progress_threads",
        f"{threaded:.2f} (same, with a busy-polling UCX progress thread per agent, as the preflight runs; "
        f"ratio {threaded / mem:.2f})",
    )
    info("memcpy_gbps", f"{mem:.2f} (numpy.copyto, {args.mib} MiB, median of {args.iterations})")
    info("total_s", f"{time.perf_counter() - t0:.1f}")


if __name__ == "__main__":
    main()
