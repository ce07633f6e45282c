"""Read metrics files into pandas: finished files, files still being written (SWMR) and files whose writer died; a
truncated or damaged file is an UnreadableMetrics error naming it, within moments, never a hang."""

from __future__ import annotations

import ctypes
import functools
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import h5py
import numpy as np
import pandas as pd

from llmd.errors import UserError
from llmd.metrics import global_heap
from llmd.metrics.schema import REQUEST_DTYPE, TIMESERIES_DTYPE, decode_columns, older_schema, upgrade
from llmd.spec.redact import redact_spec_text

# A SWMR reader retries a metadata read whose checksum fails, in case it raced the writer, sleeping twice as long each
# time; HDF5's default of 100 tries makes a damaged file hang for ever. 24 tries span about 20 ms: far longer than
# a write of one metadata block takes, so a live file still reads, and a damaged one fails at once.
SWMR_READ_ATTEMPTS = 24
_SUPERBLOCK_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_SWMR_WRITE_FLAG = 0x04  # superblock v3 file consistency flags: a SWMR writer has (or had, if killed) the file open
READ_ERRORS = (OSError, KeyError, ValueError, TypeError, IndexError, RuntimeError)


class UnreadableMetrics(UserError, OSError):
    """A metrics file that is truncated, damaged or not HDF5. An OSError too, so callers that skip files a writer
    has not flushed yet (`except OSError`) keep working."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        self.path = os.fspath(path)
        self.reason = reason
        super().__init__(
            f"{self.path} is not a readable metrics file: {reason}; it is left as it is. If it was copied, copy it "
            "again from where the run wrote it; else leave it out (llmd merge RUN_DIR FILE...) or re-run"
        )


def unreadable(path: str | os.PathLike[str], exc: BaseException) -> UnreadableMetrics:
    """The error to raise for `exc`, met while reading `path`."""
    return UnreadableMetrics(path, _reason(exc))


def _reason(exc: BaseException) -> str:
    text = exc.args[0] if exc.args and isinstance(exc.args[0], str) else str(exc)
    truncated = re.search(r"truncated file: eof = (\d+).*stored_eof = (\d+)", text)
    if truncated:
        return f"it is truncated ({truncated.group(1)} of {truncated.group(2)} bytes)"
    if "file signature not found" in text:
        return "it is not an HDF5 file (no HDF5 signature)"
    if "unable to lock file" in text:
        return "another process has it open for writing (HDF5 file lock); wait until that process ends"
    if "already open for write" in text:
        return "a writer has it open, or was killed before closing it (`h5clear -s FILE` clears that mark)"
    detail = re.sub(r"^Unable to synchronously \w+ \w+ \((.*)\)$", r"\1", text, flags=re.S)
    return f"it is damaged or cut short ({detail})"


def _swmr_writer(path: str | os.PathLike[str]) -> bool:
    """Whether the superblock says a SWMR writer has the file open (or had, and was killed before closing it)."""
    try:
        with open(path, "rb") as fh:
            offset = 0
            while offset <= 1 << 20:  # HDF5 looks for its signature at 0, 512, 1024, 2048, ...
                fh.seek(offset)
                head = fh.read(12)
                if len(head) < 12:
                    return False
                if head[:8] == _SUPERBLOCK_SIGNATURE:
                    return head[8] >= 3 and bool(head[11] & _SWMR_WRITE_FLAG)
                offset = 512 if offset == 0 else offset * 2
    except OSError:
        return False
    return False


@functools.cache
def _read_attempts_setter() -> Any:
    # h5py does not wrap H5Pset_metadata_read_attempts; its extension modules link the very libhdf5 it uses, so the
    # symbol is found through one of them (a wheel's bundled copy or a conda/system one alike).
    try:
        fn = ctypes.CDLL(h5py.h5p.__file__).H5Pset_metadata_read_attempts
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int64, ctypes.c_uint]  # hid_t is 64-bit since HDF5 1.10
    fn.restype = ctypes.c_int
    return fn


def _set_read_attempts(fapl: h5py.h5p.PropFAID, attempts: int) -> bool:
    fn = _read_attempts_setter()
    return fn is not None and fn(fapl.id, attempts) >= 0


def _open_swmr(path: str | os.PathLike[str]) -> h5py.File:
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5py.h5f.LIBVER_LATEST, h5py.h5f.LIBVER_LATEST)
    if not _set_read_attempts(fapl, SWMR_READ_ATTEMPTS):
        return h5py.File(path, "r", libver="latest", swmr=True)  # unbounded retries, as h5py alone gives
    fid = h5py.h5f.open(os.fsencode(os.fspath(path)), h5py.h5f.ACC_RDONLY | h5py.h5f.ACC_SWMR_READ, fapl=fapl)
    return h5py.File(fid)


@contextmanager
def open_metrics(path: str | os.PathLike[str]) -> Iterator[h5py.File]:
    """Open read-only. A finished file opens plainly, which checks its size against the superblock; a file a SWMR
    writer has open (or had, if killed) opens as a SWMR reader with bounded retries, so it reads as far as the writer
    got. Anything else that fails to open is UnreadableMetrics, as is a global heap libhdf5 would hang on
    (global_heap.py); a missing file stays FileNotFoundError."""
    try:
        f = h5py.File(path, "r")
    except FileNotFoundError:
        raise
    except OSError as exc:
        if not _swmr_writer(path):
            raise unreadable(path, exc) from None
        try:
            f = _open_swmr(path)
        except OSError as swmr_exc:
            raise unreadable(path, swmr_exc) from None
    why = global_heap.damage(path)  # damage libhdf5 would spin on for ever when reading a string
    if why is not None:
        f.close()
        raise UnreadableMetrics(path, f"it is damaged ({why})")
    try:
        yield f
    finally:
        f.close()


@contextmanager
def reading(path: str | os.PathLike[str]) -> Iterator[h5py.File]:
    """open_metrics, with any failure while reading (a damaged chunk, a mangled table) as UnreadableMetrics."""
    try:
        with open_metrics(path) as f:
            yield f
    except (UnreadableMetrics, FileNotFoundError):
        raise
    except READ_ERRORS as exc:
        raise unreadable(path, exc) from None


def _read_table(f: h5py.File, name: str, dtype: np.dtype) -> np.ndarray:
    """The table; one of an earlier schema version (a file from before a column was added) as this one's, with the
    columns it lacks unknown, so readers of old runs see the same columns."""
    if name not in f:
        return np.empty(0, dtype=dtype)
    ds = f[name]
    if f.swmr_mode:
        ds.refresh()  # pick up rows the writer flushed since the file was opened
        rows = _intact_rows(ds, os.path.getsize(f.filename))
        arr = ds[:rows] if rows else np.empty(0, dtype=ds.dtype)
    else:
        arr = ds[()] if ds.shape[0] else np.empty(0, dtype=ds.dtype)
    return upgrade(arr, dtype) if older_schema(arr.dtype, dtype) else arr


def _intact_rows(ds: h5py.Dataset, file_size: int) -> int:
    """Rows of a live or killed writer's table that are really on disk: up to the first chunk not yet written or lying
    (partly) past the end of the file. The table's length is extended before its chunk is written, and HDF5's file
    driver reads past the end of a truncated copy as zeros, which decompress into rows that were never written."""
    rows = ds.shape[0]
    if not rows or not ds.chunks:
        return rows
    step = ds.chunks[0]
    whole = set()
    for i in range(ds.id.get_num_chunks()):
        info = ds.id.get_chunk_info(i)
        if info.byte_offset is not None and info.byte_offset + info.size <= file_size:
            whole.add(info.chunk_offset[0])
    k = 0
    while k < rows and k in whole:
        k += step
    return min(rows, k)


def _frame(arr: np.ndarray) -> pd.DataFrame:
    return pd.DataFrame(decode_columns(arr))


def read_requests_array(path: str | os.PathLike[str]) -> np.ndarray:
    """The /requests table as a raw structured array (bytes fields undecoded)."""
    with reading(path) as f:
        return _read_table(f, "requests", REQUEST_DTYPE)


def read_requests(path: str | os.PathLike[str]) -> pd.DataFrame:
    """/requests as a DataFrame, strings decoded, one row per request (NaN / -1 / "" where unknown)."""
    with reading(path) as f:
        return _frame(_read_table(f, "requests", REQUEST_DTYPE))


def read_timeseries(path: str | os.PathLike[str], source: str | None = None) -> pd.DataFrame:
    """/timeseries as a DataFrame; `source` keeps only that producer's rows."""
    with reading(path) as f:
        df = _frame(_read_table(f, "timeseries", TIMESERIES_DTYPE))
    if source is not None:
        df = df[df["source"] == source].reset_index(drop=True)
    return df


def _attrs(obj: h5py.Group) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in obj.attrs.items():
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        elif isinstance(value, np.generic):
            value = value.item()
        out[key] = value
    return out


def _spec(group: h5py.Group) -> str:
    if "meta/spec" not in group:
        return ""
    value = group["meta/spec"][()]
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    return redact_spec_text(text)  # files written before the writer redacted must not show a token in a report


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Root attributes plus "spec" (the YAML text); merged files add "sources": {name: that input's meta}."""
    with reading(path) as f:
        meta = _attrs(f)
        meta["spec"] = _spec(f)
        if "sources" in f:
            meta["sources"] = {name: {**_attrs(g), "spec": _spec(g)} for name, g in f["sources"].items()}
    return meta
