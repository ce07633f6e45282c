"""The look every figure shares: the Agg backend (no display), sizes, a log axis where data spans decades, one colour
per label, saving, and the refusal to draw from no data."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

DPI = 150
WIDE = (8.0, 4.8)
DECADES_FOR_LOG = 2.0  # an axis whose positive values span at least this many decades is drawn log


class NoData(ValueError):
    """A figure was asked for with nothing to draw: the report leaves it out and says why."""


def plt() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as pyplot

    pyplot.rcParams.update({"axes.grid": True, "grid.alpha": 0.3, "legend.fontsize": "small", "font.size": 10})
    return pyplot


def require(condition: bool, what: str) -> None:
    if not condition:
        raise NoData(what)


def spans_decades(values: Iterable[float], decades: float = DECADES_FOR_LOG) -> bool:
    arr = np.asarray(list(values), dtype=float)
    arr = arr[np.isfinite(arr) & (arr > 0)]
    return bool(arr.size >= 2 and np.log10(arr.max() / arr.min()) >= decades)


def log_if_spans(ax: Any, values: Iterable[float], axis: str = "x") -> bool:
    """Log scale on `axis` when the values span decades; the axis label should then say "(log)"; returns whether."""
    if spans_decades(values):
        (ax.set_xscale if axis == "x" else ax.set_yscale)("log")
        return True
    return False


def thousands(axis: Any) -> None:
    """Tick labels with thousands separators (300,000 rather than 300000 or 3e5) on a linear axis."""
    from matplotlib.ticker import FuncFormatter

    if axis.get_scale() == "linear":
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}" if abs(v) >= 1000 else f"{v:g}"))


def colors(labels: Sequence[str]) -> dict[str, Any]:
    """One colour per label, the same label always the same colour within a figure set (sorted order)."""
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    return {label: cmap(i % 10) for i, label in enumerate(sorted(set(labels), key=str))}


def to_png(fig: Any) -> bytes:
    """The figure as PNG bytes (a notebook shows them with IPython.display.Image), closed after."""
    import io

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=DPI)
    plt().close(fig)
    return buf.getvalue()


def save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt().close(fig)
    return path
