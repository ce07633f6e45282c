"""analysis/sweep.ipynb runs from top to bottom on a small real sweep (tests/analysisutil.py) and every figure cell
draws: each asserts its data is there before drawing, so a cell that ran without an image would be a figure drawn
from nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from analysisutil import make_sweep

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK = Path(__file__).resolve().parents[1] / "analysis" / "sweep.ipynb"
ROOT = NOTEBOOK.parents[1]


def test_the_sweep_notebook_draws_every_figure(tmp_path_factory: pytest.TempPathFactory, monkeypatch) -> None:
    sweep = make_sweep(tmp_path_factory.getbasetemp())
    monkeypatch.setenv("LLMD_SWEEP", str(sweep))
    monkeypatch.setenv("LLMD_GPU_HOUR_USD", "2.5")
    # The kernel is a new process: it finds analysis/ and llmd/ the way this one does.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    where = {"metadata": {"path": str(ROOT)}}
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3", resources=where)
    client.execute()
    figures = [c for c in nb.cells if c.cell_type == "code" and "figure" in c.metadata.get("tags", [])]
    assert len(figures) >= 9
    for cell in figures:
        images = [o for o in cell.outputs if "image/png" in o.get("data", {})]
        assert images, f"no figure from:\n{cell.source}"
        assert all(len(o["data"]["image/png"]) > 5000 for o in images)  # base64 of a real plot, not an empty axes
    table = next(c for c in nb.cells if c.cell_type == "code" and "points(sweep)" in c.source)
    assert "4 points, parameters: router.policy, workload.concurrency" in table.outputs[0]["text"]
