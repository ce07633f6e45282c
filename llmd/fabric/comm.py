"""The out-of-band channel between the tasks of one engine component: rank, size, allgather and a barrier.

MPI (mpi4py) when a launcher gave us a world (`mpiexec`, `srun --mpi=pmi2`), a singleton world without one (a world
of one without mpi4py, e.g. on the light install). Under `srun` without a working PMI every task comes up as its own
singleton; then the same calls go through files in the run directory on the shared filesystem (FileComm), with rank
and size taken from SLURM_PROCID / SLURM_NTASKS.

No call ever blocks inside MPI: MPICH's blocking waits spin a core, which on small nodes starves the very transfers
the preflight measures. Every wait is Ibarrier() + Test() + a short sleep.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from pathlib import Path
from typing import Any, Protocol

from llmd.errors import UserError

POLL_S = 0.002
FILE_POLL_S = 0.05


class Comm(Protocol):
    rank: int
    size: int
    kind: str

    def barrier(self, timeout_s: float = ...) -> None: ...

    def allgather(self, obj: Any, timeout_s: float = ...) -> list[Any]: ...

    def fail(self, message: str, code: int) -> None: ...


class FabricTimeout(UserError):
    """Some task of the component never reached a collective step: it died, hangs, or was never started."""


class PeerFailed(UserError):
    """Another task of the component failed before it reached a collective step, and said why (FileComm.fail)."""


class MpiComm:
    """COMM_WORLD of mpi4py; a singleton world (size 1) when no launcher started us."""

    kind = "mpi"

    def __init__(self) -> None:
        # MPICH's UCX netmod puts each rank's UCX worker address (hundreds of bytes, run-length encoded) into the PMI
        # key-value store at MPI_Init; under `srun --mpi=pmi2` Slurm's PMI2 server mis-parses some of those long
        # segmented values ("mpi/pmi2: value not properly terminated in client request", then UCX "failed to unpack
        # address"): about one start in three failed on Slurm 22.05 + MPICH 5.0.2. The OFI netmod's addresses are
        # short. This world only carries the bootstrap's few small collectives (NIXL moves the data, over its own
        # UCX), so the netmod's speed does not matter. A user's own setting wins.
        os.environ.setdefault("MPIR_CVAR_CH4_NETMOD", "ofi")
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()

    def barrier(self, timeout_s: float = 600.0) -> None:
        req = self.comm.Ibarrier()
        deadline = time.monotonic() + timeout_s
        while not req.Test():
            if time.monotonic() > deadline:
                # Abort: a half-finished collective cannot be cancelled, and the other ranks would wait forever.
                raise FabricTimeout(f"rank {self.rank}: the other ranks did not reach the barrier in {timeout_s:.0f} s")
            time.sleep(POLL_S)

    def allgather(self, obj: Any, timeout_s: float = 600.0) -> list[Any]:
        # Everyone arrives first (non-blocking wait), so the blocking allgather itself only moves data.
        self.barrier(timeout_s)
        return self.comm.allgather(obj)

    def fail(self, message: str, code: int) -> None:
        """This rank cannot go on: stop every rank now (MPI_Abort; the launcher ends the job with `code`). Otherwise
        the others would wait at their next collective step until its timeout, and a rank that exits while MPI is
        up waits in MPI_Finalize for them: the component would hang instead of failing. The caller has said why."""
        if self.size > 1 and not self._mpi.Is_finalized():
            sys.stdout.flush()
            sys.stderr.flush()
            self.comm.Abort(code)


class FileComm:
    """Allgather and barrier through files in a folder every task can read (the run directory on shared storage).

    Each collective step k writes `k.<rank>` atomically (temp file + rename) and waits for all `k.*`. Files are left
    in place: they are small, and removing them could race a slow reader.
    """

    kind = "file"

    def __init__(self, folder: Path, rank: int, size: int) -> None:
        self.folder = folder
        self.rank = rank
        self.size = size
        self._step = 0
        folder.mkdir(parents=True, exist_ok=True)

    def allgather(self, obj: Any, timeout_s: float = 600.0) -> list[Any]:
        step = self._step
        self._step += 1
        mine = self.folder / f"{step}.{self.rank}"
        tmp = self.folder / f".{step}.{self.rank}.tmp"
        tmp.write_bytes(pickle.dumps(obj))
        os.replace(tmp, mine)
        deadline = time.monotonic() + timeout_s
        out: list[Any] = [None] * self.size
        missing = set(range(self.size))
        while missing:
            self._raise_if_a_peer_failed()
            for r in sorted(missing):
                path = self.folder / f"{step}.{r}"
                if path.exists():
                    out[r] = pickle.loads(path.read_bytes())
                    missing.discard(r)
            if missing:
                if time.monotonic() > deadline:
                    raise FabricTimeout(
                        f"rank {self.rank}: ranks {sorted(missing)} did not reach step {step} in {timeout_s:.0f} s "
                        f"(files in {self.folder})"
                    )
                time.sleep(FILE_POLL_S)
        return out

    def barrier(self, timeout_s: float = 600.0) -> None:
        self.allgather(None, timeout_s)

    def fail(self, message: str, code: int) -> None:
        """This rank cannot go on: leave `failed.<rank>` with why, which every other rank's waits read and raise as
        PeerFailed at once, instead of waiting out their timeout."""
        tmp = self.folder / f".failed.{self.rank}.tmp"
        tmp.write_text(message)
        os.replace(tmp, self.folder / f"failed.{self.rank}")

    def _raise_if_a_peer_failed(self) -> None:
        for path in sorted(self.folder.glob("failed.*")):
            rank = path.suffix.lstrip(".")
            if rank != str(self.rank):
                lines = path.read_text().strip().splitlines() or ["(no reason given)"]
                raise PeerFailed(f"rank {rank} of the component failed, so this one stops too: {lines[-1]}")


class LocalComm:
    """A world of one, for a single process when mpi4py is not installed (the light install)."""

    kind = "local"
    rank = 0
    size = 1

    def barrier(self, timeout_s: float = 600.0) -> None:
        return None

    def allgather(self, obj: Any, timeout_s: float = 600.0) -> list[Any]:
        return [obj]

    def fail(self, message: str, code: int) -> None:
        return None


def _slurm_int(env: dict[str, str], *names: str) -> int | None:
    for name in names:
        value = env.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def slurm_world(env: dict[str, str]) -> tuple[int, int] | None:
    """(rank, size) of this task in its srun step, if Slurm says so; hints only (PMI may still give an MPI world)."""
    size = _slurm_int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    rank = _slurm_int(env, "SLURM_PROCID")
    if size is None or rank is None or size < 1 or rank >= size:
        return None
    return rank, size


def open_comm(run_dir: Path, tag: str, env: dict[str, str] | None = None) -> Comm:
    """MPI's world, unless it is a singleton inside a multi-task srun step: then the shared-filesystem channel."""
    env = dict(os.environ) if env is None else env
    comm: MpiComm | LocalComm
    try:
        comm = MpiComm()
    except ImportError:
        comm = LocalComm()
    hint = slurm_world(env)
    if comm.size == 1 and hint is not None and hint[1] > 1:
        rank, size = hint
        # One folder per job step and attempt: the next step, or a requeued job (whose step ids start again at 0),
        # never reads an earlier one's files.
        step = (
            f"{env.get('SLURM_JOB_ID', 'job')}.{env.get('SLURM_STEP_ID', 'step')}.{env.get('SLURM_RESTART_COUNT', '0')}"
        )
        return FileComm(run_dir / ".fabric" / f"{tag}-{step}", rank, size)
    return comm
