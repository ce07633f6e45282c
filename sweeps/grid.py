"""A sweep file -> its spec variants, pure: a base spec and a grid of dotted-key overrides, every combination one
variant, each validated as a whole spec so a bad value is reported with the variant and key that carry it.

    name: policies            # results/<name>/<index>/metrics.h5
    base: ../examples/tiny-local.yaml   # a spec file (relative to this file) or an inline mapping
    grid:
      router.policy: [precise, approximate, round-robin]
      workload.concurrency: [4, 8]
"""

from __future__ import annotations

import copy
import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmd.errors import UserError
from llmd.spec import DeploymentSpec, SpecError, parse_spec
from llmd.spec.load import load_yaml
from llmd.spec.yaml_input import InputFileError, YAMLLimitError, read_text

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,47}$")
_KEY_RE = re.compile(r"^[A-Za-z0-9_-]+$")
KEYS = ("name", "base", "grid")
MAX_VARIANTS = 1000  # Slurm's default MaxArraySize is 1001


@dataclass(frozen=True)
class Variant:
    index: int
    overrides: dict[str, Any]
    spec: DeploymentSpec

    def label(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.overrides.items())


@dataclass(frozen=True)
class Sweep:
    name: str
    source: Path
    variants: list[Variant]


def _load_yaml(path: Path, what: str) -> Any:
    import yaml

    try:
        return load_yaml(read_text(path, what))
    except InputFileError as exc:
        raise UserError(f"{path}: {exc.problem}") from None
    except YAMLLimitError as exc:
        raise UserError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise UserError(f"{path}: not valid YAML: {exc}") from None


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise UserError(f"grid key {dotted!r}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def expand(doc: Any, source: Path) -> Sweep:
    """Validate a parsed sweep document and return its variants (index order: the grid's keys, last fastest)."""
    where = str(source)
    if not isinstance(doc, dict):
        raise UserError(f"{where}: a sweep is a mapping with keys {', '.join(KEYS)}")
    unknown = sorted(set(doc) - set(KEYS))
    if unknown:
        raise UserError(f"{where}: unknown key(s) {', '.join(unknown)}; a sweep has {', '.join(KEYS)}")
    name = doc.get("name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise UserError(f"{where}: name must be lowercase letters, digits, '-' or '_' (at most 48), e.g. policies")
    base = doc.get("base")
    if isinstance(base, str):
        base_path = (source.parent / base).resolve()
        base_doc = _load_yaml(base_path, "spec file")
        if base_doc is None:
            base_doc = {}
        base_where = str(base_path)
    elif isinstance(base, dict) or base is None:
        base_doc, base_where = base or {}, f"{where} (base)"
    else:
        raise UserError(f"{where}: base must be a spec file path or an inline spec mapping")
    if not isinstance(base_doc, dict):
        raise UserError(f"{base_where}: a spec is a mapping")
    grid = doc.get("grid")
    if not isinstance(grid, dict) or not grid:
        raise UserError(f"{where}: grid must map dotted spec keys to lists of values, e.g. router.policy: [a, b]")
    for key, values in grid.items():
        if not isinstance(key, str) or not all(
            _NAME_RE.match(p) or p.replace("-", "").isalnum() for p in key.split(".")
        ):
            raise UserError(f"{where}: grid key {key!r} is not a dotted spec key like router.policy")
        if not isinstance(values, list) or not values:
            raise UserError(
                f"{where}: grid.{key} must be a non-empty list of values, e.g. [{key.split('.')[-1]}1, ...]"
            )
    combos = list(itertools.product(*grid.values()))
    if len(combos) > MAX_VARIANTS:
        raise UserError(f"{where}: {len(combos)} variants; a job array takes at most {MAX_VARIANTS}: trim the grid")
    variants: list[Variant] = []
    problems: list[str] = []
    for index, combo in enumerate(combos):
        overrides = dict(zip(grid.keys(), combo, strict=True))
        data = copy.deepcopy(base_doc)
        for key, value in overrides.items():
            _set(data, key, value)
        data["name"] = f"{name}-{index}"[:64]
        try:
            variants.append(Variant(index, overrides, parse_spec(data, f"{where} variant {index}")))
        except SpecError as exc:
            label = ", ".join(f"{k}={v}" for k, v in overrides.items())
            problems.append(f"variant {index} ({label}):\n  " + "\n  ".join(str(e) for e in exc.errors))
    if problems:
        raise UserError(
            f"{where}: {len(problems)} of {len(combos)} variants are not valid specs:\n" + "\n".join(problems)
        )
    return Sweep(name, source, variants)


def load_sweep(path: Path) -> Sweep:
    return expand(_load_yaml(path, "sweep file"), path)
