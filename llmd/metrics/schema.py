"""The one metrics schema: every producer (load generator, router, engines, simulator) writes these tables.

Pure: numpy dtypes, fill values and row conversion only; HDF5 lives in writer.py / reader.py.

File layout (HDF5, libver="latest" so it can be read under SWMR while being written):

    /                 attrs: schema_version, producer, start_time (unix s), start_time_iso, host, seed,
                             llmd_version, python_version, h5py_version, hdf5_version, git_commit,
                             plus any scalar entry of the writer's `meta` dict (others JSON-encoded)
    /requests         compound, one row per request, REQUEST_COLUMNS
    /timeseries       compound, one row per (second, source), TIMESERIES_COLUMNS; every producer writes its own
                      rows tagged with `source` (one dataset, not one per source: merging is a concatenation and
                      a reader filters with `df[df.source == "router"]`). Sources: "client" (load generator),
                      "router" (its own totals), "router/<pod>" (the router's view of one pod: inflight, the pod's
                      reported waiting/running/KV usage), "<pod>" or "<pod>/dp<rank>" (an engine's own series)
    /meta/spec        scalar string: the deployment spec as YAML text ("" when none)
    /sources/<name>   merged files only: each input's root attrs and spec, kept as they were

Unknown values: floats are NaN, integers -1 (status 0 = no HTTP response), strings "". Strings are stored as
fixed-length UTF-8 bytes and truncated (on a character boundary) to their field size, never rejected.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

# 2: router columns (expected_hit_tokens, route_reason; inflight, rejected, kv_transfers)
# 3: the router's per-request KV transfer (kv_transfer_tokens, kv_transfer_bytes, kv_transfer_s)
SCHEMA_VERSION = 3

NAME_BYTES = 64
ERROR_BYTES = 256
PD_PATH_BYTES = 16

PD_PATHS = ("decode-only", "pd", "pd-fallback", "p2p")


class Column(NamedTuple):
    name: str
    dtype: str
    fill: Any
    doc: str


# The single place the column names live; docs, dtypes and fill values come from here.
REQUEST_COLUMNS: tuple[Column, ...] = (
    Column("request_id", f"S{NAME_BYTES}", b"", "request id (the client's, else the router's)"),
    Column("session", f"S{NAME_BYTES}", b"", "agentic session id"),
    Column("turn", "<i4", -1, "turn index within the session"),
    Column("is_subagent", "?", False, "request issued by a sub-agent of the session"),
    Column("send_time", "<f8", np.nan, "seconds since run start when the request was sent/received"),
    Column("router_queue_s", "<f8", np.nan, "time queued in the router before dispatch"),
    Column("ttft_s", "<f8", np.nan, "time to first token"),
    Column("e2e_s", "<f8", np.nan, "end-to-end latency"),
    Column("itl_mean_s", "<f4", np.nan, "mean inter-token latency"),
    Column("itl_p50_s", "<f4", np.nan, "median inter-token latency"),
    Column("itl_max_s", "<f4", np.nan, "largest inter-token latency"),
    Column("input_tokens", "<i4", -1, "prompt tokens"),
    Column("output_tokens", "<i4", -1, "generated tokens"),
    Column("cached_tokens", "<i4", -1, "prompt tokens served from the prefix cache"),
    Column("pod", f"S{NAME_BYTES}", b"", "decode (or only) pod that served the request"),
    Column("prefill_pod", f"S{NAME_BYTES}", b"", "prefill pod under P/D, else empty"),
    Column("pd_path", f"S{PD_PATH_BYTES}", b"", "one of PD_PATHS"),
    Column("status", "<i2", 0, "HTTP status; 0 when no response came back"),
    Column("error", f"S{ERROR_BYTES}", b"", "error text, truncated"),
    Column("source", f"S{NAME_BYTES}", b"", "producer that wrote the row (the writer fills it when empty)"),
    Column("expected_hit_tokens", "<i4", -1, "router: prompt tokens it expected cached at the chosen pod"),
    Column("route_reason", f"S{PD_PATH_BYTES}", b"", "router: why it chose the pod (prefix-hit, load, cold, ...)"),
    # The KV the serving pod took from another engine instead of computing it: under P/D (and P2P through the holder
    # as a prefill pod) the prompt less what the serving pod held in GPU KV (its CPU tier is not read for a pulled
    # request: the NIXL connector claims it); under P2P by hash the holder's prefix less that. 0 when the request
    # took no transfer (decode-only, a failed prefill hop, a retry). The live router records what it planned at
    # routing time (its KV index's view); the cluster simulator what its modelled pull moved.
    Column("kv_transfer_tokens", "<i4", -1, "router: KV tokens the serving pod pulled from another engine (0: none)"),
    Column(
        "kv_transfer_bytes",
        "<i8",
        -1,
        "router: those tokens' KV bytes over the serving pool's TP GPUs (LatencyModel.kv_transfer_bytes); -1 when "
        "the model's KV geometry is unknown",
    ),
    Column(
        "kv_transfer_s",
        "<f8",
        np.nan,
        "router: the handoff's seconds; simulator: the modelled pull (link + per-transfer overhead); live router: "
        "from sending the serving pod its leg to its first token (the pull plus that pod's queue and first step, an "
        "upper bound), NaN when not streamed; 0 without a transfer",
    ),
)

TIMESERIES_COLUMNS: tuple[Column, ...] = (
    Column("t", "<f8", np.nan, "seconds since run start (start of the 1 s bin)"),
    Column("source", f"S{NAME_BYTES}", b"", "producer of the row (client, router, engine pod name, sim)"),
    Column("tokens_in_per_s", "<f4", np.nan, "prompt tokens per second"),
    Column("tokens_out_per_s", "<f4", np.nan, "generated tokens per second"),
    Column("requests_per_s", "<f4", np.nan, "requests completed per second"),
    Column("queue_len", "<i4", -1, "requests waiting"),
    Column("running", "<i4", -1, "requests running"),
    Column("kv_usage", "<f4", np.nan, "GPU KV cache usage in [0, 1]"),
    Column("hit_share_gpu", "<f4", np.nan, "share of prompt tokens hit in GPU KV"),
    Column("hit_share_cpu", "<f4", np.nan, "share of prompt tokens hit in CPU (offloaded) KV"),
    Column("preemptions", "<i4", -1, "preemptions in the bin"),
    Column("errors", "<i4", -1, "errors in the bin"),
    Column("inflight", "<i4", -1, "router: requests it has in flight (in total, or at the row's pod)"),
    Column("rejected", "<i4", -1, "router: requests refused with 429 in the bin"),
    Column("kv_transfers", "<i4", -1, "engine: KV transfers (P/D or P2P pulls) completed in the bin"),
)

REQUEST_DTYPE = np.dtype([(c.name, c.dtype) for c in REQUEST_COLUMNS])
TIMESERIES_DTYPE = np.dtype([(c.name, c.dtype) for c in TIMESERIES_COLUMNS])

REQUEST_NAMES = frozenset(REQUEST_DTYPE.names or ())
TIMESERIES_NAMES = frozenset(TIMESERIES_DTYPE.names or ())


def pd_path_of(headers: Mapping[str, str]) -> str:
    """One of PD_PATHS from the router's response headers (x-llmd-pd, x-llmd-p2p-source): the client and the router
    name a request's path the same way."""
    pd = headers.get("x-llmd-pd", "")
    if pd == "ok":
        return "pd"
    if pd == "fallback":
        return "pd-fallback"
    if headers.get("x-llmd-p2p-source"):
        return "p2p"
    return "decode-only"


def empty_rows(dtype: np.dtype, n: int) -> np.ndarray:
    """`n` rows holding the schema's "unknown" fill values."""
    columns = REQUEST_COLUMNS if dtype == REQUEST_DTYPE else TIMESERIES_COLUMNS
    out = np.empty(n, dtype=dtype)
    for c in columns:
        out[c.name] = c.fill
    return out


def older_schema(dtype: np.dtype, schema: np.dtype) -> bool:
    """Whether `dtype` is an earlier version of `schema`'s table: some of its columns, each of the same type."""
    names = dtype.names
    fields = schema.fields or {}
    return bool(names) and all(n in fields and dtype[n] == schema[n] for n in names)


def upgrade(rows: np.ndarray, schema: np.dtype) -> np.ndarray:
    """Rows of an earlier schema version (older_schema) as `schema`'s, the columns it lacked at their fill values."""
    if rows.dtype == schema:
        return rows
    out = empty_rows(schema, len(rows))
    for name in rows.dtype.names or ():
        out[name] = rows[name]
    return out


def encode_str(value: Any, size: int) -> bytes:
    """UTF-8 bytes cut to `size` on a character boundary; None -> b"". Never raises."""
    if value is None:
        return b""
    b = value if isinstance(value, bytes) else str(value).encode("utf-8", "replace")
    if len(b) <= size:
        return b
    # Dropping the partial trailing character keeps the stored bytes valid UTF-8.
    return b[:size].decode("utf-8", "ignore").encode("utf-8")


def _fill_column(out: np.ndarray, col: Column, values: list[Any]) -> None:
    kind = out.dtype[col.name].kind
    if kind == "S":
        # Fast path: numpy encodes ASCII str and truncates over-long values by itself; it turns None into
        # b"None" and rejects non-ASCII, so those batches take the careful path.
        if None not in values:
            try:
                out[col.name] = values
                return
            except (UnicodeEncodeError, TypeError, ValueError):
                pass
        size = out.dtype[col.name].itemsize
        out[col.name] = [encode_str(v, size) for v in values]
        return
    try:
        out[col.name] = values  # None -> NaN for floats, False for bools
    except (TypeError, ValueError):
        out[col.name] = [col.fill if v is None else v for v in values]


def to_rows(rows: Any, dtype: np.dtype = REQUEST_DTYPE) -> np.ndarray:
    """Convert a batch (structured array, list of dicts, list of tuples in field order, or one dict) to `dtype`.

    Missing dict keys get the schema's fill value; unknown keys raise ValueError (a typo would otherwise drop a
    metric silently for the whole run).
    """
    columns = REQUEST_COLUMNS if dtype == REQUEST_DTYPE else TIMESERIES_COLUMNS
    names = REQUEST_NAMES if dtype == REQUEST_DTYPE else TIMESERIES_NAMES
    if isinstance(rows, np.ndarray):
        if rows.dtype == dtype:
            return rows
        if rows.dtype.names is None:
            raise ValueError(f"expected a structured array, got dtype {rows.dtype}")
        out = empty_rows(dtype, len(rows))
        for name in rows.dtype.names:
            if name not in names:
                raise ValueError(f"unknown metrics column {name!r}")
            col = next(c for c in columns if c.name == name)
            _fill_column(out, col, rows[name].tolist())
        return out
    if isinstance(rows, Mapping):
        rows = [rows]
    elif not isinstance(rows, Sequence):
        rows = list(rows)
    n = len(rows)
    if n == 0:
        return np.empty(0, dtype=dtype)
    if isinstance(rows[0], Mapping):
        _check_keys(rows, names)
        out = np.empty(n, dtype=dtype)
        for col in columns:
            fill = col.fill
            _fill_column(out, col, [r.get(col.name, fill) for r in rows])
        return out
    # Tuples in field order; short tuples are padded with fill values (e.g. without `source`).
    out = empty_rows(dtype, n)
    width = len(rows[0])
    if width > len(columns):
        raise ValueError(f"row has {width} fields, the schema {len(columns)}")
    for i, col in enumerate(columns[:width]):
        _fill_column(out, col, [r[i] for r in rows])
    return out


def _check_keys(rows: Sequence[Mapping[str, Any]], names: frozenset[str]) -> None:
    # Checking every row would cost more than the conversion; producers emit rows of one shape.
    extra = rows[0].keys() - names
    if len(rows) > 1:
        extra |= rows[-1].keys() - names
    if extra:
        raise ValueError(f"unknown metrics column(s) {sorted(extra)}")


def column_docs() -> dict[str, dict[str, str]]:
    """{"requests": {name: doc}, "timeseries": {name: doc}} for docs and `llmd` help output."""
    return {
        "requests": {c.name: f"{c.dtype}: {c.doc}" for c in REQUEST_COLUMNS},
        "timeseries": {c.name: f"{c.dtype}: {c.doc}" for c in TIMESERIES_COLUMNS},
    }


def decode_columns(arr: np.ndarray) -> dict[str, Iterable[Any]]:
    """Column dict with bytes fields decoded to str (invalid UTF-8 replaced, never raised)."""
    cols: dict[str, Iterable[Any]] = {}
    for name in arr.dtype.names or ():
        col = arr[name]
        if col.dtype.kind == "S":
            cols[name] = np.char.decode(col, "utf-8", errors="replace").astype(object)
        else:
            cols[name] = col
    return cols
