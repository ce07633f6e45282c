"""Dependencies run one way: launchers/ and sweeps/ (the control plane) use llmd, the runtime never imports them (the
command line, llmd/cli.py, alone registers their commands), launchers never import sweeps, and neither reaches into
llmd's private names. analysis/ reads what runs leave on disk: it uses llmd's metrics reader and report numbers, not
the control plane or live parts of the stack, and of llmd only the command line and the demo's drawing step (both
edges, after the run) import it. Read from the source (ast), so an import inside a function counts too."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONTROL_PLANE = ("launchers", "sweeps")
ENTRY_POINT = ROOT / "llmd" / "cli.py"
# What may import analysis/ from inside llmd: the command line (`llmd analyze`) and the demo, which draws its figures
# through analysis once its run is on disk.
ANALYSIS_USERS = (ENTRY_POINT, ROOT / "llmd" / "demo.py")
# What analysis/ may import of llmd: files, errors and the report's shared definitions, nothing that runs.
ANALYSIS_USES = ("llmd.metrics", "llmd.report.summary", "llmd.errors")


def _imports(path: Path) -> Iterator[tuple[int, str, list[str]]]:
    """(line, module, names imported from it) for every import in the file; `import a.b` gives ("a.b", [])."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module, [alias.name for alias in node.names]


def _top(module: str) -> str:
    return module.split(".")[0]


def _modules(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def test_the_runtime_imports_no_control_plane() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for path in _modules("llmd")
        if path != ENTRY_POINT
        for line, module, _ in _imports(path)
        if _top(module) in CONTROL_PLANE
    ]
    assert not found, "llmd's runtime must not import launchers/ or sweeps/:\n" + "\n".join(found)


def test_launchers_do_not_import_sweeps() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for path in _modules("launchers")
        for line, module, _ in _imports(path)
        if _top(module) == "sweeps"
    ]
    assert not found, "sweeps use launchers, not the other way round:\n" + "\n".join(found)


def test_the_control_plane_uses_only_public_names_of_llmd() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {module} {names}"
        for folder in CONTROL_PLANE
        for path in _modules(folder)
        for line, module, names in _imports(path)
        if _top(module) == "llmd"
        and any(part.startswith("_") for part in [*module.split("."), *names] if not part.startswith("__"))
    ]
    assert not found, "import a public name (or make one) instead of llmd's private ones:\n" + "\n".join(found)


def test_only_the_edges_of_the_runtime_import_analysis() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for path in _modules("llmd")
        if path not in ANALYSIS_USERS
        for line, module, _ in _imports(path)
        if _top(module) == "analysis"
    ]
    assert not found, "analysis/ reads runs from disk; the runtime must not depend on it:\n" + "\n".join(found)


def test_analysis_reads_files_not_the_running_stack() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {module} {names}"
        for path in _modules("analysis")
        for line, module, names in _imports(path)
        if _top(module) in CONTROL_PLANE
        or (_top(module) == "llmd" and not module.startswith(ANALYSIS_USES))
        or (_top(module) == "llmd" and any(n.startswith("_") for n in names))
    ]
    assert not found, f"analysis/ may use only {', '.join(ANALYSIS_USES)} of llmd (public names):\n" + "\n".join(found)


def test_the_checks_see_imports() -> None:
    # Guard against a check that passes because it reads nothing.
    assert any(_top(m) == "launchers" for _, m, _ in _imports(ENTRY_POINT))
    assert any(m == "llmd.spec.load" for p in _modules("sweeps") for _, m, _ in _imports(p))
    assert any(_top(m) == "analysis" for p in ANALYSIS_USERS for _, m, _ in _imports(p))
    assert any(m == "llmd.metrics" for p in _modules("analysis") for _, m, _ in _imports(p))
