"""The two ways to install llmd (pip via pyproject.toml, conda via environment.yml) must not drift apart."""

from __future__ import annotations

import tomllib
from pathlib import Path

import yaml
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def _norm(req: str) -> tuple[str, str]:
    r = Requirement(req)
    return r.name.lower().replace("_", "-"), str(r.specifier)


def _pyproject_requirements() -> set[tuple[str, str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        reqs += extra
    return {_norm(r) for r in reqs}


def _conda_pip_requirements() -> tuple[set[tuple[str, str]], list[str]]:
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_sections = [d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d]
    assert len(pip_sections) == 1, "environment.yml must have exactly one pip section"
    entries = pip_sections[0]
    reqs = {_norm(e) for e in entries if not e.startswith("-")}
    return reqs, [e for e in entries if e.startswith("-")]


def test_environment_yml_declares_the_same_dependencies_as_pyproject() -> None:
    conda, _ = _conda_pip_requirements()
    pip = _pyproject_requirements()
    assert conda - pip == set(), f"only in environment.yml: {sorted(conda - pip)}"
    assert pip - conda == set(), f"only in pyproject.toml: {sorted(pip - conda)}"


def test_environment_yml_installs_the_project_and_pins_python() -> None:
    _, options = _conda_pip_requirements()
    assert "-e ." in options
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pythons = [d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python")]
    required = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert pythons and pythons[0].split("=")[-1] in {"3.11", "3.12"}, pythons
    assert required == ">=3.11"
