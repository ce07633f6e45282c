"""The simulator process's heap in transparent huge pages (llmd/sim/_hugepages.c says why and how).

`enable()` once a process is going to simulate: Python's object arenas come from a region marked for huge pages, and
glibc's heap grows in steps that `grow()` (called as the run goes) marks. A run's results do not depend on it, only
its speed: what the simulation computes never depends on where objects live. Off with LLMD_HUGE_PAGES=0, where the C
part was not built, or where the system has transparent huge pages off ("never").
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
from pathlib import Path
from typing import Any

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# Python's arena size: 1 MiB on 64-bit builds since 3.10 (obmalloc's USE_LARGE_ARENAS), 256 KiB before. Arenas of any
# other size are served by the allocator that was there before, so a wrong guess costs the speed-up, not correctness.
_ARENA = 1 << 20 if sys.maxsize > 2**32 and sys.version_info >= (3, 10) else 1 << 18
# Address space reserved for arenas (MAP_NORESERVE: nothing is committed until written), at most.
_MOST = 64 << 30

_state: dict[str, Any] = {"tried": False, "on": False, "why": "not enabled yet", "region": 0}


def _regions() -> list[int]:
    """Sizes to try reserving, largest first: at most the machine's memory, and at most a quarter of an address-space
    limit (`ulimit -v`, as some clusters set for jobs): the reservation counts against that limit, and the run needs
    the rest of it. Smaller tries follow where the system refuses (strict overcommit)."""
    most = _MOST
    with contextlib.suppress(ValueError, OSError):  # a system that does not say: the default
        most = min(most, os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        most = min(most, soft // 4)
    return [r for r in (most, most // 4, most // 16) if r >= 64 * _ARENA]


def _native() -> Any:
    try:
        from llmd.sim import _hugepages  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _hugepages


_C: Any = _native()


def why_not() -> str:
    """Why huge pages are not in use ('' when they are)."""
    return "" if _state["on"] else str(_state["why"])


def enable() -> bool:
    """Python's arenas and glibc's heap in huge pages from now on, for the rest of the process; True if in use."""
    if _state["tried"]:
        return bool(_state["on"])
    _state["tried"] = True
    if os.environ.get("LLMD_HUGE_PAGES") == "0":
        _state["why"] = "LLMD_HUGE_PAGES=0"
        return False
    native = _C
    if native is None:
        _state["why"] = "llmd.sim._hugepages was not built"
        return False
    try:
        mode = _THP.read_text()
    except OSError:
        _state["why"] = f"no {_THP}"
        return False
    if "[never]" in mode:
        _state["why"] = "transparent huge pages are off on this system"
        return False
    for region in _regions():
        if native.use_arenas(region, _ARENA):
            native.grow_heap()  # from here on glibc's heap grows in steps that grow() marks
            _state.update(on=True, why="", region=region)
            return True
    _state["why"] = "no address space could be reserved for the arenas"
    return False


def grow() -> None:
    """Mark what glibc's heap grew by since the last call (cheap: one sbrk(0) when it did not grow)."""
    if _state["on"]:
        _C.grow_heap()


def stats() -> dict[str, int]:
    """The C part's counters (arenas handed out new, reused, freed, served elsewhere; bytes used) and the region's
    size; {} when off."""
    return {**_C.stats(), "region_bytes": _state["region"]} if _state["on"] else {}
