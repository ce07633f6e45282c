"""One profile file (gpus.yaml, models.yaml, efficiency.yaml) read into checked fields, or a UserError that names the
file, the entry and the field, and says what to do."""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from collections.abc import Collection, Mapping
from typing import Any

import yaml

from llmd.errors import UserError
from llmd.perf.units import parse_quantity
from llmd.spec.yaml_input import BoundedLoader, InputFileError, load_file

_MERGE_TAG = "tag:yaml.org,2002:merge"

# A field's type as a profile file may give it: float, int, bool, or the choices of a Literal.
FieldType = type | tuple[str, ...]


class _Loader(BoundedLoader):
    """SafeLoader that refuses a repeated key: YAML keeps only the last one, so a second entry for one GPU (or a field
    given twice) would silently win."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[str, int] = {}
        for key, _ in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != _MERGE_TAG:
                line = key.start_mark.line + 1
                first = seen.setdefault(key.value, line)
                if first != line:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"{key.value!r} is given twice (first at line {first}); delete one", key.start_mark
                    )
        return super().construct_mapping(node, deep=deep)


def entry_error(path: str | os.PathLike[str], kind: str, name: str, field: str | None, problem: str) -> UserError:
    where = f"{os.fspath(path)}: {kind} {name!r}" + (f", field {field!r}" if field else "")
    return UserError(f"{where}: {problem}")


def read_entries(path: str | os.PathLike[str], kind: str) -> dict[str, dict[str, Any]]:
    """The file's entries: {name: {field: raw value}}, in file order. An empty file has none."""
    try:
        data = load_file(path, f"{kind} profile file", _Loader)
    except InputFileError as e:
        raise UserError(f"cannot read {e.path}: {e.problem}; check the path") from None
    if data is None:
        return {}
    example = "H100-80GB: {mfu: 0.5}" if kind == "GPU" else "llama-3.1-8b: {kv_bytes_per_element: 1}"
    if not isinstance(data, dict):
        raise UserError(
            f"{os.fspath(path)}: expected a mapping of {kind} names to their fields (like `{example}`), "
            f"got {type(data).__name__}"
        )
    entries: dict[str, dict[str, Any]] = {}
    for name, fields in data.items():
        if not isinstance(name, str):
            raise UserError(f"{os.fspath(path)}: {kind} name {name!r} is not text; quote it")
        if not isinstance(fields, dict):
            raise entry_error(path, kind, name, None, f"expected a mapping of its fields (like `{example}`)")
        entries[name] = fields
    return entries


def pop_base(
    path: str | os.PathLike[str], kind: str, name: str, raw: Mapping[str, Any]
) -> tuple[dict[str, Any], str | None]:
    """`raw` without its `base` key, and the name `base` gives (None without one)."""
    rest = dict(raw)
    base = rest.pop("base", None)
    if base is not None and not isinstance(base, str):
        raise entry_error(path, kind, name, "base", f"expected the name of a {kind} to start from, got {base!r}")
    return rest, base


def field_types(cls: type) -> dict[str, FieldType]:
    """The fields of a profile dataclass a file may set (all but `name`), with their types."""
    hints = typing.get_type_hints(cls)
    types: dict[str, FieldType] = {}
    for field in dataclasses.fields(cls):
        if field.name == "name":
            continue
        hint = hints[field.name]
        types[field.name] = typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else hint
    return types


def check_fields(
    path: str | os.PathLike[str],
    kind: str,
    name: str,
    raw: Mapping[str, Any],
    types: Mapping[str, FieldType],
    units: Mapping[str, str],
    *,
    positive: Collection[str] = (),
    fractions: Collection[str] = (),
    also: Collection[str] = (),
) -> dict[str, Any]:
    """`raw` checked field by field against `types`: numbers with the unit `units` names (SI when none is written),
    at least 0, above 0 for `positive`, in (0, 1] for `fractions`. `also` are the other keys the caller allows, for
    the message about an unknown one."""
    checked: dict[str, Any] = {}
    for field, value in raw.items():
        if field not in types:
            known = [*also, *types]
            close = difflib.get_close_matches(str(field), known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            problem = f"unknown field; {hint}a {kind} entry takes: {', '.join(known)}"
            if field == "name":
                problem = "the entry's key is its name; remove this field"
            raise entry_error(path, kind, name, str(field), problem)
        try:
            checked[field] = _check_value(value, types[field], units.get(field), field in positive, field in fractions)
        except ValueError as e:
            raise entry_error(path, kind, name, field, f"{e}; fix the value") from None
    return checked


def _check_value(value: Any, kind: FieldType, unit: str | None, positive: bool, fraction: bool) -> Any:
    if isinstance(kind, tuple):
        if value not in kind:
            raise ValueError(f"{value!r} is not one of {', '.join(kind)}")
        return value
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
        return value
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            number: float = value
        else:
            number = parse_quantity(value, None)
            if number != int(number):
                raise ValueError(f"expected a whole number, got {value!r}")
            number = int(number)
    else:
        number = parse_quantity(value, unit)
    if fraction and not 0 < number <= 1:
        raise ValueError(f"{value!r} is out of range: it is a fraction in (0, 1]")
    if positive and number <= 0:
        raise ValueError(f"{value!r} is out of range: it must be above 0")
    if number < 0:
        raise ValueError(f"{value!r} is out of range: it must not be negative")
    return number
