"""`llmd demo` end to end: simulated engines, real HTTP and ZMQ on 127.0.0.1, the KV index, results on disk."""

from __future__ import annotations

import json

import pytest

from llmd.cli import main

pytestmark = pytest.mark.integration


def test_demo_runs_end_to_end_and_precise_routing_beats_round_robin(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)  # the embedded default makes its tokenizer under ./models/tiny
    rc = main(["demo", "--sessions", "6", "--turns", "4", "--engines", "3", "--output", str(tmp_path / "results")])
    assert rc == 0
    assert (tmp_path / "models" / "tiny" / "tokenizer.json").exists()
    (run,) = (tmp_path / "results").iterdir()
    rows = {r["policy"]: r for r in json.loads((run / "summary.json").read_text())}
    requests = json.loads((run / "requests.json").read_text())
    assert len(requests) == 2 * 6 * 4
    assert rows["precise"]["requests"] == rows["round-robin"]["requests"] == 24
    # Same sessions, fresh prefixes per policy: only the routing differs.
    assert rows["precise"]["cache_hit_share"] > rows["round-robin"]["cache_hit_share"]
    # The index, fed only by the engines' KV events, predicts the engines' own cached-token counts.
    assert rows["precise"]["index_exact_share"] >= 0.8
    assert "precise" in capsys.readouterr().out


def test_demo_rejects_bad_counts_with_a_clear_message(capsys) -> None:
    assert main(["demo", "--sessions", "0"]) == 2
    assert "--sessions must be at least 1" in capsys.readouterr().err


def test_demo_with_a_spec_whose_model_has_no_tokenizer_names_the_fix(tmp_path, capsys) -> None:
    spec = tmp_path / "s.yaml"
    spec.write_text(f"model:\n  path: {tmp_path / 'nowhere'}\n")
    assert main(["demo", "--spec", str(spec)]) == 2
    assert "llmd model make-tiny" in capsys.readouterr().err
