"""`llmd sweep status`'s per-point table, and the progress display while `llmd sweep` follows its arrays (a rich bar
and table on a terminal, a line per change elsewhere, so logs and tests read plain text)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sweeps.state import STATES, PointStatus, counts, sweep_status


def _value(v: Any) -> str:
    return "-" if v is None else str(v)


def one_line(reason: str) -> str:
    """A cause on one table row: its first line and, when it quotes a log, the log's last line (the error)."""
    lines = [ln.strip() for ln in reason.splitlines() if ln.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else ""
    return f"{lines[0]} ... {lines[-1]}"


def summary(points: list[PointStatus]) -> str:
    c = counts(points)
    return f"{len(points)} points: " + ", ".join(f"{c[s]} {s}" for s in STATES)


def render_table(points: list[PointStatus]) -> str:
    """One row per point: index, parameters, state, array task, requests, errors, reason; then the counts."""
    keys: list[str] = []
    for p in points:
        keys += [k for k in p.params if k not in keys]
    head = ["#", *keys, "state", "job", "requests", "errors", "reason"]
    rows = [
        [str(p.index), *(_value(p.params.get(k)) for k in keys), p.state, p.job or "-", _value(p.requests),
         _value(p.errors), one_line(p.reason)]
        for p in points
    ]  # fmt: skip
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    # The reason is last and left unpadded: it is as long as it needs to be (a failure's cause).
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(r[:-1], widths[:-1], strict=True)) + "  " + r[-1] for r in [head, *rows]
    ]
    return "\n".join(line.rstrip() for line in lines) + "\n" + summary(points)


def follow_sweep(
    root: Path,
    rows: list[dict[str, Any]],
    poll_s: float,
    out: Callable[[str], None] = print,
    status: Callable[[], list[PointStatus]] | None = None,
) -> list[PointStatus]:
    """Until no point is queued or running: a live bar and table on a terminal, else a line whenever a point changes
    state. Returns the last statuses."""
    read = status or (lambda: sweep_status(root, rows))
    if sys.stdout.isatty():
        return _follow_live(read, poll_s)
    seen: dict[int, str] = {}
    while True:
        points = read()
        for p in points:
            if seen.get(p.index) != p.state:
                seen[p.index] = p.state
                said = f" ({one_line(p.reason)})" if p.reason and p.state in ("failed", "running") else ""
                out(f"[{time.strftime('%H:%M:%S')}] point {p.index} {p.state}{said}; {summary(points)}")
        if not _active(points):
            return points
        time.sleep(poll_s)


def _active(points: list[PointStatus]) -> bool:
    return any(p.state == "running" or (p.state == "pending" and p.reason != "not submitted") for p in points)


def _follow_live(read: Callable[[], list[PointStatus]], poll_s: float) -> list[PointStatus]:
    from rich.console import Group
    from rich.live import Live
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    points = read()
    task = progress.add_task("points done", total=len(points))

    def view(points: list[PointStatus]) -> Group:
        table = Table(box=None, pad_edge=False)
        for col in ("#", "parameters", "state", "job", "requests", "errors", "reason"):
            table.add_column(col, overflow="fold")
        colour = {"done": "green", "failed": "red", "running": "cyan", "pending": "dim"}
        # The points worth watching: running and failed ones first, the rest summed up in the bar.
        shown = [p for p in points if p.state in ("running", "failed")][:30]
        for p in shown:
            params = ", ".join(f"{k}={v}" for k, v in p.params.items())
            table.add_row(str(p.index), params, f"[{colour[p.state]}]{p.state}", p.job, _value(p.requests),
                          _value(p.errors), one_line(p.reason))  # fmt: skip
        progress.update(task, completed=counts(points)["done"], description=summary(points))
        return Group(progress, table)

    with Live(view(points), refresh_per_second=2) as live:
        while _active(points):
            time.sleep(poll_s)
            points = read()
            live.update(view(points))
    return points
