"""The run folder convention (llmd.metrics.run_files): every process of a launched run gets a file of its own that no
later attempt overwrites, and the merge finds them all in a stable order."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmd.metrics.run_files import attempt_number, engine_metrics_path, run_inputs


def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return path


def test_engine_files_are_per_attempt_and_never_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    first = _touch(engine_metrics_path(tmp_path, "decode-0"))
    assert first == tmp_path / "parts" / "engines" / "decode-0-a0.h5"
    again = engine_metrics_path(tmp_path, "decode-0")  # the same attempt re-run (a restarted node)
    assert again.name == "decode-0-a0-2.h5"
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    assert attempt_number() == 3
    assert engine_metrics_path(tmp_path, "decode-0").name == "decode-0-a3.h5"
    monkeypatch.setenv("SLURM_RESTART_COUNT", "not-a-number")
    assert attempt_number() == 0


def test_run_inputs_lists_clients_routers_engines_and_fabric_in_order(tmp_path: Path) -> None:
    files = [
        _touch(tmp_path / "parts" / "attempt-10" / "metrics.h5"),
        _touch(tmp_path / "parts" / "attempt-2" / "metrics.h5"),
        _touch(tmp_path / "parts" / "attempt-2" / "router.h5"),
        _touch(tmp_path / "parts" / "engines" / "prefill-0-a2.h5"),
        _touch(tmp_path / "fabric-decode.h5"),
        _touch(tmp_path / "metrics.h5"),  # the merged file itself is never an input
    ]
    got = run_inputs(tmp_path)
    assert got == [files[1], files[0], files[2], files[3], files[4]]
