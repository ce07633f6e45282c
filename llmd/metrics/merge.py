"""Merge per-process metrics files (client, router, each engine) into one run file with the same schema."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import h5py

from llmd.metrics.reader import READ_ERRORS, open_metrics, reading, unreadable
from llmd.metrics.schema import (
    NAME_BYTES,
    REQUEST_DTYPE,
    SCHEMA_VERSION,
    TIMESERIES_DTYPE,
    encode_str,
    older_schema,
    upgrade,
)
from llmd.metrics.writer import COMPRESSION, REQUEST_CHUNK_ROWS, TIMESERIES_CHUNK_ROWS, run_attrs
from llmd.spec.redact import redact_spec_text

# Bounded memory whatever the input size: ~600 B a request row.
_BLOCK_ROWS = 1 << 20


def _unique_name(name: str, taken: set[str]) -> str:
    # Two inputs from the same producer (e.g. a restarted engine) stay apart instead of overwriting /sources/<name>.
    base, k = name or "input", 2
    out = base
    while out in taken:
        out = f"{base}#{k}"
        k += 1
    taken.add(out)
    return out


def _copy_table(
    src: h5py.Dataset,
    dst: h5py.Dataset,
    time_field: str,
    shift_s: float,
    old_name: bytes,
    new_name: bytes,
    swmr: bool,
    path: Path,
) -> None:
    with _reads_of(path):
        if swmr:
            src.refresh()
        n = src.shape[0]
    for lo in range(0, n, _BLOCK_ROWS):
        with _reads_of(path):
            block = upgrade(src[lo : min(n, lo + _BLOCK_ROWS)], dst.dtype)
        if shift_s:
            block[time_field] += shift_s
        if old_name != new_name:
            block["source"][block["source"] == old_name] = new_name
        start = dst.shape[0]
        dst.resize((start + len(block),))
        dst[start:] = block


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:
        return a.resolve() == b.resolve()


def merge_runs(
    inputs: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    *,
    overwrite: bool = False,
) -> Path:
    """Concatenate /requests and /timeseries of `inputs` (rows keep their `source`) into `output`.

    Times are moved onto one clock: each input's `send_time` / `t` is relative to its own start_time, the output's
    to the earliest start_time. Each input's root attributes and spec are kept under /sources/<producer>. Inputs may
    still be being written (read as SWMR) or come from a killed writer. The output is written beside and moved into
    place only when whole, so a damaged input (UnreadableMetrics, naming it) leaves no half-merged file, and an
    input is never the output: nothing already written is overwritten or truncated.
    """
    output = Path(output)
    paths = [Path(p) for p in inputs]
    clash = next((p for p in paths if _same_file(p, output)), None)
    if clash is not None:
        raise ValueError(
            f"{output} is also an input ({clash}); merging into it would destroy it: choose another output"
        )
    if not overwrite and output.exists():
        raise FileExistsError(f"{output} exists; pass overwrite=True or choose another path")
    metas: list[tuple[Path, dict[str, object], str]] = []
    for p in paths:
        with reading(p) as f:
            spec = f["meta/spec"][()] if "meta/spec" in f else b""
            text = spec.decode("utf-8", "replace") if isinstance(spec, bytes) else str(spec)
            metas.append((p, dict(f.attrs.items()), redact_spec_text(text)))  # inputs from before redaction too
    tmp = output.with_name(f".{output.name}.{os.getpid()}.merging")
    try:
        _write_merged(tmp, metas)
        _move_into_place(tmp, output, overwrite)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return output


def _move_into_place(tmp: Path, output: Path, overwrite: bool) -> None:
    if overwrite:
        os.replace(tmp, output)
        return
    try:
        os.link(tmp, output)  # fails if the output appeared meanwhile: never replaces a file
    except FileExistsError:
        raise FileExistsError(f"{output} exists; pass overwrite=True or choose another path") from None
    except OSError:  # a filesystem without hard links
        if output.exists():
            raise FileExistsError(f"{output} exists; pass overwrite=True or choose another path") from None
        os.replace(tmp, output)
        return
    tmp.unlink()


def _write_merged(target: Path, metas: list[tuple[Path, dict[str, object], str]]) -> None:
    starts = [float(m["start_time"]) for _, m, _ in metas if "start_time" in m]
    t0 = min(starts) if starts else 0.0
    taken: set[str] = set()
    with h5py.File(target, "w", libver="latest") as out:
        names = []
        for _, attrs, _ in metas:
            producer = attrs.get("producer", "")
            producer = producer.decode() if isinstance(producer, bytes) else str(producer)
            names.append((producer, _unique_name(producer, taken)))
        base = run_attrs("merge", {}, t0)
        for key, value in base.items():
            out.attrs[key] = value
        # The run's own metadata (policy, seed, profile, run id, ...) stays at the root: the first input that has a
        # key gives its value, as a reader of a one-producer file would find it.
        for _, attrs, _ in metas:
            for key, value in attrs.items():
                if (key not in base and key not in out.attrs) or (key == "seed" and out.attrs["seed"] == -1):
                    out.attrs[key] = value
        out.attrs["schema_version"] = SCHEMA_VERSION
        out.attrs["sources"] = json.dumps([new for _, new in names])
        out.create_group("meta").create_dataset("spec", data=metas[0][2] if metas else "", dtype=h5py.string_dtype())
        req = out.create_dataset(
            "requests",
            shape=(0,),
            maxshape=(None,),
            dtype=REQUEST_DTYPE,
            chunks=(REQUEST_CHUNK_ROWS,),
            compression=COMPRESSION,
        )
        ts = out.create_dataset(
            "timeseries",
            shape=(0,),
            maxshape=(None,),
            dtype=TIMESERIES_DTYPE,
            chunks=(TIMESERIES_CHUNK_ROWS,),
            compression=COMPRESSION,
        )
        sources = out.create_group("sources")
        for (path, attrs, spec), (old, new) in zip(metas, names, strict=True):
            g = sources.create_group(new)
            for key, value in attrs.items():
                g.attrs[key] = value
            g.attrs["path"] = str(path)
            g.create_group("meta").create_dataset("spec", data=spec, dtype=h5py.string_dtype())
            shift = float(attrs["start_time"]) - t0 if "start_time" in attrs else 0.0
            old_b, new_b = encode_str(old, NAME_BYTES), encode_str(new, NAME_BYTES)
            with open_metrics(path) as f:
                for name, dst, tf in (("requests", req, "send_time"), ("timeseries", ts, "t")):
                    with _reads_of(path):
                        src = f.get(name)
                        dtype = None if src is None else src.dtype
                    if src is None:
                        continue
                    # A file of an earlier schema version (a run from before a column was added) merges with its
                    # new columns unknown; anything else is not this schema.
                    if dtype is None or not older_schema(dtype, dst.dtype):
                        raise ValueError(f"{path}:/{name} has dtype {dtype}, expected schema {dst.dtype}")
                    _copy_table(src, dst, tf, shift, old_b, new_b, f.swmr_mode, path)
                with _reads_of(path):
                    roles = list(f["fabric"]) if "fabric" in f else []
                if roles:
                    # The fabric preflight's bandwidth matrices (llmd.fabric.record): /fabric/<role>, kept as written.
                    fabric = out.require_group("fabric")
                    for role in roles:
                        copy_name = _unique_name(role, set(fabric.keys()))
                        with _reads_of(path):
                            f.copy(f["fabric"][role], fabric, name=copy_name)


@contextmanager
def _reads_of(path: Path) -> Iterator[None]:
    """Reads of an input file: their failures say that input is unreadable. Writes to the output stay outside, so a
    full disk is reported as itself, not blamed on an input."""
    try:
        yield
    except READ_ERRORS as exc:
        raise unreadable(path, exc) from None
