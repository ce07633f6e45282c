"""The fabric preflight: real NIXL transfers between every ordered pair of nodes, one pair at a time, as a bandwidth
matrix; and the verdict on it (which links are below the threshold).

Each rank creates a NIXL agent (UCX backend) and registers one host buffer of 2 x N bytes: a source half filled with
a pattern of its own and a destination half the peers write into. Agent metadata and buffer addresses are exchanged
with allgather only after the memory is registered (NIXL sends registrations with the metadata). For each ordered
pair (i, j) every rank meets at a barrier, rank i WRITEs its source half into j's destination half once untimed
(connection set-up) and `iterations` times timed, everyone meets again and rank j checks that the bytes arrived.
Bandwidth = N / median time, in GB/s (10^9 B/s). Matrix[i, j] is the link i -> j; the diagonal is NaN (no link is
measured from a node to itself).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from llmd.fabric.comm import Comm

BACKEND = "UCX"
XFER_TIMEOUT_S = 60.0


@dataclass
class PreflightResult:
    role: str
    nbytes: int
    iterations: int
    hostnames: list[str]
    gbps: np.ndarray  # [size, size], NaN on the diagonal and where a transfer failed
    times_s: np.ndarray  # [size, size, iterations], NaN where not measured
    errors: list[str] = field(default_factory=list)  # failed or corrupted transfers, one line each
    backend: str = BACKEND
    started: float = 0.0

    @property
    def size(self) -> int:
        return len(self.hostnames)


def _nixl() -> tuple[Any, Any]:
    """nixl_agent and nixl_agent_config, with NIXL's INFO chatter (on stdout) off unless NIXL_LOG_LEVEL asks for it."""
    from nixl._api import nixl_agent, nixl_agent_config

    if not os.environ.get("NIXL_LOG_LEVEL"):
        logging.getLogger("nixl").setLevel(logging.WARNING)
    return nixl_agent, nixl_agent_config


def link_name(role: str, src: int, dst: int, hostnames: Sequence[str]) -> str:
    return f"{role} rank {src} ({hostnames[src]}) -> rank {dst} ({hostnames[dst]})"


def slow_links(gbps: np.ndarray, min_gbps: float, hostnames: Sequence[str], role: str) -> list[str]:
    """One line per link below `min_gbps` (a failed link, NaN off the diagonal, counts as 0), slowest first."""
    lines = []
    n = gbps.shape[0]
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            value = float(gbps[i, j])
            value = 0.0 if math.isnan(value) else value
            if value < min_gbps:
                lines.append((value, f"{link_name(role, i, j, hostnames)}: {value:.2f} GB/s < {min_gbps:g} GB/s"))
    return [line for _, line in sorted(lines, key=lambda t: t[0])]


def _pattern(rank: int) -> int:
    # Non-zero and distinct for neighbouring ranks, so a missing or misdirected write shows.
    return 1 + (rank * 37) % 251


def _wait_xfer(
    agent, handle, timeout_s: float = XFER_TIMEOUT_S, peer_progress: Callable[[], object] | None = None
) -> str:
    deadline = time.monotonic() + timeout_s
    state = agent.check_xfer_state(handle)
    polls = 0
    while state == "PROC":
        if time.monotonic() > deadline:
            return "TIMEOUT"
        polls += 1
        if peer_progress is not None and polls % 64 == 0:
            peer_progress()  # an in-process peer without a progress thread answers only when someone polls it
        # A very short sleep: the progress thread needs the core, but timing must stay close to the transfer's.
        time.sleep(0.00005)
        state = agent.check_xfer_state(handle)
    return state


def run_preflight(comm: Comm, nbytes: int, iterations: int, role: str, hostname: str | None = None) -> PreflightResult:
    """Measure every ordered pair of ranks; every rank returns the same, complete result."""
    nixl_agent, nixl_agent_config = _nixl()
    if nbytes < 1 or iterations < 1:
        raise ValueError("preflight needs nbytes >= 1 and iterations >= 1")
    hostname = hostname or socket.gethostname()
    rank, size = comm.rank, comm.size
    started = time.time()
    # Unique per run: a peer still holding an earlier run's agent of the same name would be confused by it.
    name = f"llmd-{role}-{rank}-{uuid.uuid4().hex[:8]}"
    agent = nixl_agent(name, nixl_agent_config(backends=[BACKEND]))
    buf = np.zeros(2 * nbytes, dtype=np.uint8)
    buf[:nbytes] = _pattern(rank)
    base = buf.ctypes.data
    reg = agent.register_memory([(base, 2 * nbytes, 0, "")], "DRAM")
    try:
        # After registering: the metadata carries the registrations the peers need.
        peers = comm.allgather((name, agent.get_agent_metadata(), base, hostname))
        hostnames = [p[3] for p in peers]
        for r, (_, meta, _, _) in enumerate(peers):
            if r != rank:
                agent.add_remote_agent(meta)
        local = agent.get_xfer_descs([(base, nbytes, 0)], "DRAM")
        times = np.full((size, iterations), np.nan)
        errors: list[str] = []
        for src in range(size):
            for dst in range(size):
                if src == dst:
                    continue
                if rank == dst:
                    buf[nbytes:] = 0
                comm.barrier()
                if rank == src:
                    err = _measure(agent, local, peers[dst], nbytes, times[dst], iterations)
                    if err:
                        errors.append(f"{link_name(role, src, dst, hostnames)}: {err}")
                comm.barrier()
                if rank == dst and not np.all(buf[nbytes:] == _pattern(src)):
                    errors.append(f"{link_name(role, src, dst, hostnames)}: data arrived corrupted or incomplete")
        rows = comm.allgather((times, errors))
    finally:
        agent.deregister_memory(reg)
        del agent
    all_times = np.stack([t for t, _ in rows])  # [src, dst, iteration]
    all_errors = [e for _, errs in rows for e in errs]
    with np.errstate(invalid="ignore", divide="ignore"):
        median = np.array([[_median(all_times[i, j]) for j in range(size)] for i in range(size)], dtype=float).reshape(
            size, size
        )
        gbps = nbytes / median / 1e9
    bad = {_link_of(e) for e in all_errors}
    for i, j in bad:
        gbps[i, j] = np.nan
    return PreflightResult(role, nbytes, iterations, hostnames, gbps, all_times, all_errors, BACKEND, started)


def _median(values: np.ndarray) -> float:
    good = [float(v) for v in values if not math.isnan(v)]
    return statistics.median(good) if good else math.nan


def _link_of(error: str) -> tuple[int, int]:
    # "<role> rank I (host) -> rank J (host): ..." -- parsed back so a corrupted link reads as failed in the matrix.
    head = error.split(":", 1)[0]
    left, _, right = head.partition(" -> ")
    return int(left.split(" rank ")[1].split()[0]), int(right.split("rank ")[1].split()[0])


def _measure(
    agent,
    local,
    peer: tuple,
    nbytes: int,
    out: np.ndarray,
    iterations: int,
    peer_progress: Callable[[], object] | None = None,
) -> str | None:
    peer_name, _, peer_base, _ = peer
    remote = agent.get_xfer_descs([(peer_base + nbytes, nbytes, 0)], "DRAM")
    handle = agent.initialize_xfer("WRITE", local, remote, peer_name, b"")
    try:
        # One untimed transfer first: the first one on a new peer also sets up the UCX endpoint.
        for k in range(-1, iterations):
            t0 = time.perf_counter()
            state = agent.transfer(handle)
            if state == "PROC":
                state = _wait_xfer(agent, handle, peer_progress=peer_progress)
            if state != "DONE":
                return f"transfer {k + 2} ended in state {state}"
            if k >= 0:
                out[k] = time.perf_counter() - t0
    finally:
        agent.release_xfer_handle(handle)
    return None


def pair_bandwidth(nbytes: int, iterations: int, progress_thread: bool = True) -> tuple[float, list[str]]:
    """GB/s of NIXL WRITEs between two agents in this process (host memory, UCX), median of `iterations`, with the
    same transfer loop as the preflight; and errors (a failed transfer, bytes that did not arrive).

    progress_thread=False: no UCX progress threads; the waiting thread drives both agents (one process can; ranks in
    separate processes cannot, so the preflight keeps the threads). Each thread busy-polls, which on a small machine
    takes cores away from the copy being measured.
    """
    nixl_agent, nixl_agent_config = _nixl()
    tag = uuid.uuid4().hex[:8]
    config = nixl_agent_config(enable_prog_thread=progress_thread, backends=[BACKEND])
    agents = [nixl_agent(f"llmd-pair-{k}-{tag}", config) for k in (0, 1)]
    bufs = [np.zeros(2 * nbytes, dtype=np.uint8) for _ in agents]
    bufs[0][:nbytes] = _pattern(0)
    regs = [a.register_memory([(b.ctypes.data, 2 * nbytes, 0, "")], "DRAM") for a, b in zip(agents, bufs, strict=True)]
    try:
        agents[0].add_remote_agent(agents[1].get_agent_metadata())
        local = agents[0].get_xfer_descs([(bufs[0].ctypes.data, nbytes, 0)], "DRAM")
        times = np.full(iterations, np.nan)
        peer = (agents[1].name, None, bufs[1].ctypes.data, "")
        progress = None if progress_thread else agents[1].get_new_notifs
        err = _measure(agents[0], local, peer, nbytes, times, iterations, progress)
        errors = [err] if err else []
        if not err and not np.all(bufs[1][nbytes:] == _pattern(0)):
            errors.append("data arrived corrupted or incomplete")
    finally:
        for a, r in zip(agents, regs, strict=True):
            a.deregister_memory(r)
    return nbytes / _median(times) / 1e9, errors
