"""The soak benchmark's quick mode (benchmarks/soak.py --quick): 200 agents with sub-agent bursts through the router
to two simulated decode engines, then a decode engine SIGKILLed mid-stream and one SIGSTOPped for a few seconds.
Asserts behaviour, not speed (the machine may be loaded): no client errors and no preemptions without faults, both
faults survived (the pod left routing and came back, requests were served after it), nothing hung, every HDF5 written
(client, router, each engine incarnation, the SIGKILLed one's too) reads."""

from __future__ import annotations

import pytest
from benchutil import load_benchmark


@pytest.mark.integration
@pytest.mark.timeout(420)
def test_soak_quick(capsys: pytest.CaptureFixture[str]) -> None:
    soak = load_benchmark("soak")
    out = soak.main(["--quick"])
    printed = capsys.readouterr().out
    assert out["requests"] > 50, printed
    assert out["client_errors"] == 0, printed
    assert out["preemptions"] == 0, printed
    assert out["n_faults"] == 2 and out["survived"] == 2, printed
    assert not out["hang"], printed
    assert out["h5_ok"] == out["h5_total"] >= 5 and not out["h5_bad"], printed
    for name, f in out["faults"].items():
        assert f["unexpected"] == 0, (name, printed)
    assert "client_errors: 0  # target <= 0" in printed and "faults_survived: 2" in printed
