"""Profile tables built from layers of data files: the built-in ones in llmd/perf/data, then each folder on
LLMD_PERF_PATH, then each folder given to add_profile_dir. A later layer adds names or overrides fields of earlier
ones; an entry may start from another with `base: NAME`. Built on first use and kept until reset_profiles()."""

from __future__ import annotations

import difflib
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from llmd.errors import UserError
from llmd.perf.profile_file import entry_error, read_entries

DATA_DIR = Path(__file__).resolve().parent / "data"
ENV_VAR = "LLMD_PERF_PATH"
PROFILE_FILES = ("gpus.yaml", "models.yaml", "efficiency.yaml")

P = TypeVar("P")
# (file, entry name, its raw fields) -> (checked fields, `base` or None)
ReadEntry = Callable[[Path, str, dict[str, Any]], tuple[dict[str, Any], str | None]]
# (name, resolved fields) -> profile; raises ValueError (or TypeError) for a bad combination of fields.
MakeProfile = Callable[[str, dict[str, Any]], P]

_added_dirs: list[Path] = []
_tables: list[ProfileTable[Any]] = []


def profile_dirs() -> list[Path]:
    """The user's profile folders in the order they apply: LLMD_PERF_PATH left to right, then add_profile_dir's."""
    from_env = [Path(part).expanduser() for part in os.environ.get(ENV_VAR, "").split(os.pathsep) if part]
    for folder in from_env:
        _check_dir(folder, f"{ENV_VAR} names {folder}")
    return [*from_env, *(d for d in _added_dirs if d not in from_env)]


def add_profile_dir(path: str | os.PathLike[str]) -> None:
    """Apply the gpus.yaml / models.yaml / efficiency.yaml in folder `path` over everything before it (built-ins,
    LLMD_PERF_PATH, folders added earlier) from the next look-up of GPUS or MODELS on."""
    folder = Path(path).expanduser()
    _check_dir(folder, f"add_profile_dir({os.fspath(path)!r})")
    if folder not in _added_dirs:
        _added_dirs.append(folder)
    for table in _tables:
        table.reset()


def reset_profiles() -> None:
    """Forget the folders add_profile_dir added and every table built; the next look-up reads the files again
    (LLMD_PERF_PATH as it is then)."""
    _added_dirs.clear()
    for table in _tables:
        table.reset()


def _check_dir(folder: Path, what: str) -> None:
    if not folder.is_dir():
        raise UserError(f"{what}, which is not a folder; give a folder that holds {' and/or '.join(PROFILE_FILES)}")
    if not any((folder / name).is_file() for name in PROFILE_FILES):
        raise UserError(f"{what}, which holds none of {', '.join(PROFILE_FILES)}; name the profile files so")


@dataclass
class _Entry:
    fields: dict[str, Any]
    base: str | None
    sources: list[str] = field(default_factory=list)
    base_source: str = ""


def _merge(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    # A nested mapping (a model's `config`) merges key by key, so an override may change one config.json field.
    out = dict(old)
    for key, value in new.items():
        old_value = out.get(key)
        out[key] = {**old_value, **value} if isinstance(value, dict) and isinstance(old_value, dict) else value
    return out


class ProfileTable(Mapping[str, P]):
    """name -> profile, as the layers of `filename` say (and, for each folder, its `overlay` file after all of them:
    efficiency.yaml for GPUs). Built on first use; `reset` makes the next use build it again. A profile no user
    file touches stays the very object the built-in table holds, so `is` comparisons survive a reset."""

    def __init__(
        self,
        kind: str,
        filename: str,
        read_entry: ReadEntry,
        make: MakeProfile[P],
        overlay: tuple[str, Callable[[Path], dict[str, dict[str, Any]]]] | None = None,
    ) -> None:
        self.kind, self.filename = kind, filename
        self._read_entry, self._make, self._overlay = read_entry, make, overlay
        self._lock = threading.Lock()
        self._table: dict[str, P] | None = None
        self._builtin: dict[str, tuple[dict[str, Any], P]] | None = None
        _tables.append(self)

    def reset(self) -> None:
        self._table = None

    def _get(self) -> dict[str, P]:
        table = self._table
        if table is None:
            with self._lock:
                if self._table is None:
                    self._table = self._build(profile_dirs())
                table = self._table
        return table

    def __getitem__(self, name: str) -> P:
        return self._get()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())

    def __contains__(self, name: object) -> bool:
        return name in self._get()

    def __repr__(self) -> str:
        return f"ProfileTable({self.kind}: {', '.join(self._get())})"

    # ---- building ---------------------------------------------------------------------------------------------

    def _build(self, dirs: list[Path]) -> dict[str, P]:
        if self._builtin is None:
            self._builtin = {
                name: (fields, self._make_one(name, fields, sources))
                for name, (fields, sources) in self._resolve([DATA_DIR]).items()
            }
        builtin = self._builtin
        if not dirs:
            return {name: profile for name, (_, profile) in builtin.items()}
        table: dict[str, P] = {}
        for name, (fields, sources) in self._resolve([DATA_DIR, *dirs]).items():
            known = builtin.get(name)
            if known is not None and known[0] == fields:
                table[name] = known[1]
            else:
                table[name] = self._make_one(name, fields, sources)
        return table

    def _resolve(self, folders: list[Path]) -> dict[str, tuple[dict[str, Any], list[str]]]:
        """Every entry's fields after the layers in `folders` and bases, with the files it came from."""
        entries: dict[str, _Entry] = {}
        for folder in folders:
            path = folder / self.filename
            if not path.is_file():
                continue
            for name, raw in read_entries(path, self.kind).items():
                fields, base = self._read_entry(path, name, raw)
                entry = entries.setdefault(name, _Entry({}, None))
                entry.fields = _merge(entry.fields, fields)
                entry.sources.append(str(path))
                if base is not None:
                    entry.base, entry.base_source = base, str(path)
        if self._overlay is not None:
            filename, read = self._overlay
            for folder in folders:
                path = folder / filename
                if path.is_file():
                    for name, fields in read(path).items():
                        if name not in entries:
                            problem = f"no such {self.kind}; {_known(self.kind, name, entries)}"
                            raise entry_error(path, self.kind, name, None, problem)
                        entries[name].fields = _merge(entries[name].fields, fields)
                        entries[name].sources.append(str(path))
        resolved: dict[str, tuple[dict[str, Any], list[str]]] = {}
        for name in entries:
            self._resolve_one(name, entries, resolved, ())
        return {name: resolved[name] for name in entries}

    def _resolve_one(
        self,
        name: str,
        entries: dict[str, _Entry],
        resolved: dict[str, tuple[dict[str, Any], list[str]]],
        chain: tuple[str, ...],
    ) -> dict[str, Any]:
        if name in resolved:
            return resolved[name][0]
        entry = entries[name]
        fields = entry.fields
        if entry.base is not None:
            if entry.base not in entries:
                problem = f"no {self.kind} named {entry.base!r} to start from; {_known(self.kind, entry.base, entries)}"
                raise entry_error(entry.base_source, self.kind, name, "base", problem)
            if entry.base == name or entry.base in chain:
                loop = " -> ".join([*chain, name, entry.base])
                raise entry_error(
                    entry.base_source, self.kind, name, "base", f"bases go round in a loop ({loop}); break it"
                )
            fields = _merge(self._resolve_one(entry.base, entries, resolved, (*chain, name)), fields)
        resolved[name] = (fields, entry.sources)
        return fields

    def _make_one(self, name: str, fields: dict[str, Any], sources: list[str]) -> P:
        try:
            return self._make(name, fields)
        except (ValueError, TypeError) as e:
            files = ", then ".join(dict.fromkeys(sources))
            raise UserError(f"{self.kind} {name!r} (from {files}): {e}") from None


def _known(kind: str, name: str, names: Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(name, list(names), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"{hint}known {kind} names: {', '.join(names)}"
