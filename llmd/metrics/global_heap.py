"""A look at an HDF5 file's global heap collections before libhdf5 reads them, for the damage it would loop on for ever.

Variable-length strings (the metrics files' attributes: git commit, host, versions; the spec) live in global heap
collections ("GCOL" blocks). libhdf5 (2.0.0 here, H5HG__cache_heap_deserialize) walks a collection's objects by their
sizes, and a free-space object (index 0) advances by its size alone: one whose size reads 0 never advances, and the
read spins at full CPU inside C code, where no signal or timeout reaches it. A single damaged byte is enough (a
string's length shortened, so the walk lands inside the string's text on a zero). This walks each collection as
libhdf5 would and names that damage, and objects that run past their collection's end, so the reader can refuse the
file instead of hanging.

Collections are found by their signature: a file has no index of them short of following every variable-length
reference. Raw data (lzf chunks of fixed-width columns) would have to hold "GCOL", version 1 and a size that fits the
file by chance to be taken for one. The search is a memory-mapped scan: ~0.4 s for 500 MB, once per version of a
file (a file found sound is not scanned again until it changes).
"""

from __future__ import annotations

import mmap
import os
from collections import OrderedDict

_SIGNATURE = b"GCOL"
_SUPERBLOCK = b"\x89HDF\r\n\x1a\n"
_MIN_COLLECTION = 4096  # H5HG_MINSIZE: libhdf5 never writes a smaller collection

# Files found sound, by what any write to them changes (size, modification and change times): a notebook re-reading
# a run, or a sweep's hundred runs read again and again, pays the scan once per version of each file, not at every
# open. A run still being written changes between reads and is scanned each time. Only a rewrite of the same size
# within the clock tick of a scan would go unseen.
_SOUND: OrderedDict[tuple[int, ...], None] = OrderedDict()
_SOUND_MAX = 4096


def _length_size(mm: mmap.mmap) -> int:
    """Bytes of a "length" field in this file (the superblock says; 8 in every file llmd writes)."""
    offset = 0
    while offset + 16 <= len(mm) and offset <= 1 << 20:  # the superblock is at 0, 512, 1024, 2048, ...
        if mm[offset : offset + 8] == _SUPERBLOCK:
            version = mm[offset + 8]
            # v0/v1: sizes at bytes 13-14; v2/v3: at 9-10.
            size = mm[offset + 14] if version < 2 else mm[offset + 10]
            return size if size in (2, 4, 8) else 8
        offset = 512 if offset == 0 else offset * 2
    return 8


def _walk(mm: mmap.mmap, start: int, length: int) -> str | None:
    """What is wrong with the collection at `start`, walked as libhdf5 walks it; None when nothing would stall it.
    Not a collection at all (another version, a size that does not fit the file): None, for libhdf5 to judge."""
    head = 8 + length  # signature, version, 3 reserved, collection size
    if start + head > len(mm) or mm[start + 4] != 1:
        return None
    size = int.from_bytes(mm[start + 8 : start + head], "little")
    if size < _MIN_COLLECTION or start + size > len(mm):
        return None
    end = start + size
    obj = 8 + length  # index (2), references (2), reserved (4), size
    p = start + head
    while p < end:
        if p + obj > end:
            return None  # too little left for an object header: libhdf5 takes it as free space
        index = int.from_bytes(mm[p : p + 2], "little")
        n = int.from_bytes(mm[p + 8 : p + obj], "little")
        need = obj + (n + 7) // 8 * 8 if index else n  # an object's data is padded to 8 bytes; free space is not
        if need == 0:
            return f"its global heap at byte {start} has a free-space record of size 0 at byte {p}"
        if p + need > end:
            return f"an object in its global heap at byte {start} runs past the heap's end (at byte {p})"
        p += need
    return None


def damage(path: str | os.PathLike[str]) -> str | None:
    """Why libhdf5 would hang reading `path`'s variable-length data, or None. Missing or unreadable: None (the
    caller's own open reports that)."""
    try:
        with open(path, "rb") as fh:
            st = os.fstat(fh.fileno())
            if st.st_size == 0:
                return None
            key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            if key in _SOUND:
                _SOUND.move_to_end(key)
                return None
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                length = _length_size(mm)
                at = mm.find(_SIGNATURE)
                while at >= 0:
                    why = _walk(mm, at, length)
                    if why is not None:
                        return why
                    at = mm.find(_SIGNATURE, at + 1)
    except (OSError, ValueError):
        return None
    _SOUND[key] = None
    if len(_SOUND) > _SOUND_MAX:
        _SOUND.popitem(last=False)
    return None
