"""Each request's KV transfer (a P/D handoff or a P2P pull) from the router's rows: its size and time, and the run's
numbers over them. What a row holds (llmd.metrics.schema): the cluster simulator's modelled pull exactly; the live
router's planned tokens, their bytes from the model's geometry, and the serving leg's time to its first output (the
pull within it, so an upper bound; NaN when not streamed). Runs written before the router recorded transfers
(metrics schema < 3) read with those columns unknown: `transfer_rows` is None for them.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

MIB = 2**20


def transfer_rows(router_rows: pd.DataFrame) -> pd.DataFrame | None:
    """The router's rows of requests whose serving pod pulled KV (kv_transfer_tokens > 0); None when no row records
    a transfer size at all (an older file, or no router rows)."""
    if not len(router_rows) or "kv_transfer_tokens" not in router_rows:
        return None
    tokens = router_rows["kv_transfer_tokens"].astype(int)
    if not (tokens >= 0).any():
        return None
    return router_rows[tokens > 0]


def sizes_mib(rows: pd.DataFrame) -> np.ndarray | None:
    """Each transfer's size in MiB; None when any of them has no bytes (the model's geometry was unknown)."""
    nbytes = rows["kv_transfer_bytes"].to_numpy(dtype=float)
    return nbytes / MIB if len(nbytes) and (nbytes >= 0).all() else None


def numbers(router_rows: pd.DataFrame) -> dict[str, float | int | None]:
    """kv_transfer_requests (None: not recorded), the mean and p90 of bytes and of seconds per transfer (NaN where
    the rows have none)."""
    rows = transfer_rows(router_rows)
    out: dict[str, float | int | None] = {"kv_transfer_requests": None if rows is None else len(rows)}
    for name in ("bytes", "s"):
        v = rows[f"kv_transfer_{name}"].to_numpy(dtype=float) if rows is not None else np.empty(0)
        v = v[np.isfinite(v) & (v >= 0)]
        out[f"kv_transfer_{name}_mean"] = float(v.mean()) if v.size else math.nan
        out[f"kv_transfer_{name}_p90"] = float(np.percentile(v, 90)) if v.size else math.nan
    return out
