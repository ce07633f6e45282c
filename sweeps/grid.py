"""A sweep file -> its points, pure: a base spec and its axes of dotted-key overrides (a grid, one zipped block,
seed replicates), every combination one point, each validated as a whole spec so a bad value is reported with the
point and key that carry it.

    name: policies            # results/<name>/<index>/metrics.h5
    base: ../examples/tiny-local.yaml   # a spec file (relative to this file) or an inline mapping
    grid:                     # every combination of these
      router.policy: [precise, approximate, round-robin]
      workload.concurrency: [4, 8]
    zip:                      # one more axis: these keys' lists varied together (equal lengths)
      prefill.nodes: [1, 2, 3]
      decode.nodes: [3, 2, 1]
    seeds: 3                  # replicates: workload.seed = base seed, +1, +2 at every point of the rest
    throttle: 4               # at most 4 points at once (the array's %4); `llmd sweep --throttle` overrides
"""

from __future__ import annotations

import copy
import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from llmd.errors import UserError
from llmd.spec import DeploymentSpec, SpecError, parse_spec
from llmd.spec.load import load_yaml
from llmd.spec.yaml_input import InputFileError, YAMLLimitError, read_text

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,47}$")
_KEY_RE = re.compile(r"^[A-Za-z0-9_-]+$")
KEYS = ("name", "base", "grid", "zip", "seeds", "throttle")
MAX_VARIANTS = 1000  # Slurm's default MaxArraySize is 1001
SEED_KEY = "workload.seed"


@dataclass(frozen=True)
class Variant:
    """One point of the sweep: its index (its folder and array task id), the overrides that make it, its spec."""

    index: int
    overrides: dict[str, Any]
    spec: DeploymentSpec

    @property
    def seed(self) -> int:
        return self.spec.workload.seed

    def label(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.overrides.items())


@dataclass(frozen=True)
class Sweep:
    name: str
    source: Path
    variants: list[Variant]
    throttle: int | None = None  # points at once; None: as many as Slurm grants

    @property
    def keys(self) -> list[str]:
        """The parameters: the dotted keys the points differ in, in index order (the last varies fastest)."""
        return list(self.variants[0].overrides) if self.variants else []


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


def _field_default(path: list[str]) -> Any:
    """The spec's default at a dotted path naming a mapping field (router.weights), else None: overriding one weight
    keeps the others rather than leaving a mapping that holds only the new key."""
    model: type[BaseModel] = DeploymentSpec
    for i, part in enumerate(path):
        field = model.model_fields.get(part)
        if field is None:
            return None
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
            continue
        if i == len(path) - 1:
            default = field.get_default(call_default_factory=True)
            return copy.deepcopy(default) if isinstance(default, dict) else None
        return None
    return None


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = _field_default(parts[: i + 1]) or {}
        if not isinstance(child, dict):
            raise UserError(f"grid key {dotted!r}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def _check_key(where: str, block: str, key: Any) -> None:
    if not isinstance(key, str) or not all(_NAME_RE.match(p) or p.replace("-", "").isalnum() for p in key.split(".")):
        raise UserError(f"{where}: {block} key {key!r} is not a dotted spec key like router.policy")


def _axes(doc: dict[str, Any], where: str, base_seed: int) -> list[list[dict[str, Any]]]:
    """Each axis as its list of override sets: a grid key's values, the zip block's rows, the seeds."""
    grid, zipped, seeds = doc.get("grid"), doc.get("zip"), doc.get("seeds")
    if grid is None and zipped is None and seeds is None:
        raise UserError(f"{where}: a sweep needs grid:, zip: or seeds:, e.g. grid: {{router.policy: [a, b]}}")
    axes: list[list[dict[str, Any]]] = []
    if grid is not None:
        if not isinstance(grid, dict) or not grid:
            raise UserError(f"{where}: grid must map dotted spec keys to lists of values, e.g. router.policy: [a, b]")
        for key, values in grid.items():
            _check_key(where, "grid", key)
            if not isinstance(values, list) or not values:
                raise UserError(
                    f"{where}: grid.{key} must be a non-empty list of values, e.g. [{key.split('.')[-1]}1, ...]"
                )
            axes.append([{key: v} for v in values])
    if zipped is not None:
        if not isinstance(zipped, dict) or not zipped:
            raise UserError(f"{where}: zip must map dotted spec keys to lists of equal length, varied together")
        lengths = set()
        for key, values in zipped.items():
            _check_key(where, "zip", key)
            if key in (grid or {}):
                raise UserError(f"{where}: {key} is in both grid and zip; an axis belongs to one of them")
            if not isinstance(values, list) or not values:
                raise UserError(f"{where}: zip.{key} must be a non-empty list of values")
            lengths.add(len(values))
        if len(lengths) > 1:
            shown = ", ".join(f"{k}: {len(v)}" for k, v in zipped.items())
            raise UserError(f"{where}: zip's lists are varied together, so they need one length; they have {shown}")
        axes.append([dict(zip(zipped, row, strict=True)) for row in zip(*zipped.values(), strict=True)])
    if seeds is not None:
        if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
            raise UserError(f"{where}: seeds must be a positive number of replicates, e.g. seeds: 3")
        if SEED_KEY in (grid or {}) or SEED_KEY in (zipped or {}):
            raise UserError(f"{where}: seeds: sets {SEED_KEY}; drop it from grid/zip, or drop seeds:")
        # The same seeds at every other point (common random numbers): policies are compared on the same sessions.
        axes.append([{SEED_KEY: base_seed + r} for r in range(seeds)])
    return axes


def _load_base(doc: dict[str, Any], where: str, source: Path) -> tuple[dict[str, Any], str]:
    base = doc.get("base")
    if isinstance(base, str):
        base_path = (source.parent / base).resolve()
        base_doc = _load_yaml(base_path, "spec file")
        if base_doc is None:
            base_doc = {}
        base_where = str(base_path)
    elif isinstance(base, dict) or base is None:
        base_doc, base_where = copy.deepcopy(base or {}), f"{where} (base)"
    else:
        raise UserError(f"{where}: base must be a spec file path or an inline spec mapping")
    if not isinstance(base_doc, dict):
        raise UserError(f"{base_where}: a spec is a mapping")
    return base_doc, base_where


def expand(doc: Any, source: Path) -> Sweep:
    """Validate a parsed sweep document and return its points (index order: grid keys, then zip, then seeds; the
    last varies fastest)."""
    where = str(source)
    if not isinstance(doc, dict):
        raise UserError(f"{where}: a sweep is a mapping with keys {', '.join(KEYS)}")
    unknown = sorted(set(doc) - set(KEYS))
    if unknown:
        raise UserError(f"{where}: unknown key(s) {', '.join(unknown)}; a sweep has {', '.join(KEYS)}")
    name = doc.get("name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise UserError(f"{where}: name must be lowercase letters, digits, '-' or '_' (at most 48), e.g. policies")
    throttle = doc.get("throttle")
    if throttle is not None and (isinstance(throttle, bool) or not isinstance(throttle, int) or throttle < 1):
        raise UserError(f"{where}: throttle must be a positive number of points at once, e.g. throttle: 4")
    base_doc, _ = _load_base(doc, where, source)
    workload = base_doc.get("workload") if isinstance(base_doc.get("workload"), dict) else {}
    base_seed = workload.get("seed", 0) if isinstance(workload.get("seed", 0), int) else 0
    axes = _axes(doc, where, base_seed)
    total = 1
    for axis in axes:
        total *= len(axis)
    if total > MAX_VARIANTS:
        raise UserError(f"{where}: {total} points; a job array takes at most {MAX_VARIANTS}: trim the grid")
    variants: list[Variant] = []
    problems: list[str] = []
    for index, combo in enumerate(itertools.product(*axes)):
        overrides = {k: v for part in combo for k, v in part.items()}
        data = copy.deepcopy(base_doc)
        for key, value in overrides.items():
            _set(data, key, value)
        data["name"] = f"{name}-{index}"[:64]
        try:
            variants.append(Variant(index, overrides, parse_spec(data, f"{where} point {index}")))
        except SpecError as exc:
            label = ", ".join(f"{k}={v}" for k, v in overrides.items())
            problems.append(f"point {index} ({label}):\n  " + "\n  ".join(str(e) for e in exc.errors))
    if problems:
        raise UserError(f"{where}: {len(problems)} of {total} points are not valid specs:\n" + "\n".join(problems))
    return Sweep(name, source, variants, throttle)


def load_sweep(path: Path) -> Sweep:
    return expand(_load_yaml(path, "sweep file"), path)
