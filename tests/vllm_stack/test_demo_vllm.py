"""`llmd demo --engine vllm --short` end to end, as a user runs it from an empty folder: the tiny model is made with
weights, a real vLLM prefill and decode server start with NIXL between them, the router runs P/D over them, and the
HDF5 holds a row for every request the decode server saw."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from vllmutil import require_vllm

from llmd.metrics import read_requests

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

DEMO_TIMEOUT_S = 540  # start-up (~1.5 min, more on a loaded machine), 5 s of load, the grace, the report


def test_demo_on_real_vllm_servers(tmp_path: Path) -> None:
    require_vllm()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    cmd = [sys.executable, "-m", "llmd.cli", "demo", "--engine", "vllm", "--short", "--output", "results"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=DEMO_TIMEOUT_S)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    assert "1 prefill + 1 decode" in done.stdout, done.stdout
    (h5,) = (tmp_path / "results").glob("*/metrics.h5")
    rows = read_requests(h5)
    client = rows[rows["source"] == "client"]
    assert len(client) > 0, done.stdout
    # Every request served in full: a row cut at the demo's grace or by its per-request timeout keeps the 200 it got
    # before streaming began, so the error and the token count are checked too, and a failure shows the whole row.
    bad = client[(client["status"] != 200) | (client["error"] != "") | ~(client["output_tokens"] > 0)]
    cols = ["request_id", "send_time", "status", "error", "ttft_s", "e2e_s", "input_tokens", "output_tokens", "pd_path"]
    assert bad.empty, (
        f"{bad[cols].to_string()}\nall rows:\n{client[cols].to_string()}\n"
        f"stdout:\n{done.stdout[-2000:]}\nstderr:\n{done.stderr[-2000:]}"
    )
    # Real P/D: the router sent prompts through the prefill server and the decode server pulled their KV.
    assert (client["pd_path"] == "pd").any(), client["pd_path"].value_counts().to_string()
    # vLLM's own preemption counter over the run (no per-second series from real servers): the router's KV admission
    # keeps what it sends a pod within the KV the pod reports, so nothing is preempted.
    summary = json.loads((h5.parent / "summary.json").read_text())
    assert summary["preemptions"] == 0, summary
    # Every request the decode server answered is a row (its access log, less the deployment's warm-up request), once
    # more for each whose KV pull failed (on a loaded machine a NIXL handshake can time out): the router retried those
    # on the decode server without a transfer, and the rows above say they were then served in full.
    log = (h5.parent / "engines" / "decode-0.log").read_text(errors="replace")
    served = len(re.findall(r'"POST /v1/(?:chat/)?completions HTTP/1\.1" 200', log)) - 1
    failed_pulls = sum(int(n) for n in re.findall(r"Failing (\d+) request\(s\) due to KV load failure", log))
    assert len(client) + failed_pulls == served, (len(client), failed_pulls, served)
