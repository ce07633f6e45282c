"""global_heap.damage: the global heap collections libhdf5 would spin on for ever, found before it reads them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llmd.metrics import MetricsWriter, global_heap
from llmd.metrics.global_heap import damage

SIZE = 4096


def _collection(objects: list[tuple[int, bytes]], free: int | None = None) -> bytes:
    """A GCOL collection of SIZE bytes (8-byte lengths): its objects, then a free-space record of the rest (or of
    `free` bytes, as damage would have it)."""
    body = b"".join(
        i.to_bytes(2, "little") + b"\x01\x00" + bytes(4) + len(d).to_bytes(8, "little") + d + bytes(-len(d) % 8)
        for i, d in objects
    )
    rest = SIZE - 16 - len(body)
    body += bytes(4) + bytes(4) + (rest if free is None else free).to_bytes(8, "little")
    return b"GCOL\x01\x00\x00\x00" + SIZE.to_bytes(8, "little") + body + bytes(SIZE - 16 - len(body))


def _file(tmp_path: Path, blob: bytes) -> Path:
    path = tmp_path / "f.h5"
    path.write_bytes(b"\x89HDF\r\n\x1a\n\x03\x08\x08" + bytes(501) + blob)  # a v3 superblock's head, 8-byte lengths
    return path


def test_a_sound_collection_and_a_file_without_any_pass(tmp_path: Path) -> None:
    assert damage(_file(tmp_path, _collection([(1, b"abc"), (2, b"name: fuzz\n")]))) is None
    assert damage(_file(tmp_path, b"no heaps here" * 100)) is None
    assert damage(tmp_path / "missing.h5") is None  # the caller's open reports that


def test_a_zero_size_free_space_record_is_named(tmp_path: Path) -> None:
    why = damage(_file(tmp_path, _collection([(1, b"abc")], free=0)))
    assert why is not None and "free-space record of size 0" in why and "byte 512" in why


def test_an_object_past_the_collection_end_is_named(tmp_path: Path) -> None:
    blob = bytearray(_collection([(1, b"abc")]))
    blob[16 + 8 : 16 + 16] = (SIZE * 2).to_bytes(8, "little")  # object 1 claims twice the collection
    why = damage(_file(tmp_path, bytes(blob)))
    assert why is not None and "runs past the heap's end" in why


def test_what_is_not_a_collection_is_left_to_libhdf5(tmp_path: Path) -> None:
    # Another version, a size below libhdf5's minimum or beyond the file: not judged here.
    for head in (b"GCOL\x02\x00\x00\x00", b"GCOL\x01\x00\x00\x00" + (64).to_bytes(8, "little")):
        blob = bytearray(_collection([(1, b"abc")], free=0))
        blob[: len(head)] = head
        assert damage(_file(tmp_path, bytes(blob))) is None
    assert damage(_file(tmp_path, _collection([(1, b"abc")], free=0)[:2000])) is None


def test_the_writers_files_pass(tmp_path: Path) -> None:
    path = tmp_path / "metrics.h5"
    with MetricsWriter(path, "client", {"spec": "name: x\n", "seed": 3}) as w:
        w.append_requests([{"request_id": f"r{i}", "ttft_s": 0.1} for i in range(100)])
    assert b"GCOL" in path.read_bytes() and damage(path) is None


def test_a_sound_file_is_scanned_once_until_it_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A notebook re-reading a run pays the scan once; a write to the file (a live run's) makes it look again."""
    path = _file(tmp_path, _collection([(1, b"abc")]))
    walks = []
    real = global_heap._walk
    monkeypatch.setattr(global_heap, "_walk", lambda *a: walks.append(a) or real(*a))
    assert damage(path) is None and len(walks) == 1
    assert damage(path) is None and len(walks) == 1  # the same version of the file: not scanned again
    with path.open("ab") as fh:
        fh.write(_collection([(1, b"abc")], free=0))  # a damaged collection appended, as a writer might
    why = damage(path)
    assert len(walks) == 3 and why is not None and "free-space record of size 0" in why
    assert damage(path) is not None  # damage is found at every look, never remembered as sound
    st = path.stat()
    path.write_bytes(path.read_bytes()[:-SIZE])  # sound again, and the same size as the version read first
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert damage(path) is None and len(walks) == 6
