"""Where the processes of a launched run (llmd launch) write their metrics files, and which of them merge into the
run's metrics.h5. One convention for the main job (client, router), the engine starters (sim engines) and the fabric
preflight, so none of them has to know the others' names:

    RUN/parts/attempt-<n>/metrics.h5   the benchmark client of attempt n (a requeued job is attempt n+1)
    RUN/parts/attempt-<n>/router.h5    the router of attempt n
    RUN/parts/engines/<name>-a<n>.h5   engine <name> of attempt n (-2, -3, ... if that name was taken)
    RUN/fabric-<role>[-k].h5           the preflight bandwidth matrix (llmd.fabric.record)

Every file is only ever created, never overwritten, so a requeue or a re-run of an attempt keeps what came before.
"""

from __future__ import annotations

import os
from pathlib import Path


def attempt_number() -> int:
    """The Slurm restart count of this job (0 for the first run), the attempt a file belongs to."""
    try:
        return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


def engine_metrics_path(run_dir: Path, name: str, attempt: int | None = None) -> Path:
    """A fresh path for engine `name`'s metrics in this attempt; its folder exists."""
    folder = Path(run_dir) / "parts" / "engines"
    folder.mkdir(parents=True, exist_ok=True)
    n = attempt_number() if attempt is None else attempt
    return fresh_path(folder, f"{name}-a{n}")


def fresh_path(folder: Path, stem: str) -> Path:
    """FOLDER/STEM.h5, or STEM-2.h5, STEM-3.h5, ... when taken: a run's files are created, never overwritten."""
    path = Path(folder) / f"{stem}.h5"
    k = 2
    while path.exists():
        path = Path(folder) / f"{stem}-{k}.h5"
        k += 1
    return path


def _attempt_key(p: Path) -> tuple[int, str]:
    digits = "".join(ch for ch in p.parent.name.removeprefix("attempt-") if ch.isdigit())
    return (int(digits) if digits else 0, p.parent.name)


def run_inputs(run_dir: Path) -> list[Path]:
    """Every per-process file of a run, in a stable order: clients, routers, engines, fabric matrices."""
    run_dir = Path(run_dir)
    parts = run_dir / "parts"
    clients = sorted(parts.glob("attempt-*/metrics.h5"), key=_attempt_key)
    routers = sorted(parts.glob("attempt-*/router.h5"), key=_attempt_key)
    engines = sorted((parts / "engines").glob("*.h5"))
    fabric = sorted(run_dir.glob("fabric-*.h5"))
    return [*clients, *routers, *engines, *fabric]
