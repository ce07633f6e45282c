"""The public peer routers the benchmarks hold llmd against (sglang-router, vllm-router): installed from PyPI into a
side venv (.venv-peers) the first time, and the command line that runs each one, or llmd's router, on a given fleet."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from _report import free_port, info

ROOT = Path(__file__).resolve().parent.parent
# Router kind -> its PyPI package. The kinds llmd runs itself are "llmd" and "llmd-affinity".
PEER_PACKAGES = {"sglang": "sglang-router", "vllm-router": "vllm-router"}
PEERS_VENV = ROOT / ".venv-peers"


def peers_python() -> Path | None:
    """The side venv's python with both peers installed (installing them the first time), or None."""
    py = PEERS_VENV / "bin" / "python"
    try:
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", str(PEERS_VENV)], check=True, capture_output=True)
        missing = [
            pkg
            for pkg in PEER_PACKAGES.values()
            if subprocess.run([str(py), "-m", "pip", "show", "-q", pkg], capture_output=True).returncode != 0
        ]
        if missing:
            subprocess.run(
                [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", *missing],
                check=True,
                capture_output=True,
                timeout=600,
            )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        err = getattr(exc, "stderr", b"") or b""
        info("peers", f"could not install {', '.join(PEER_PACKAGES.values())}: {exc} {err.decode()[-300:]}")
        return None
    return py


def router_cmd(kind: str, arg: str, spec: Path, port: int, urls: list[str], peers: Path | None) -> list[str] | None:
    """The command line of router `kind` with policy `arg` on `port` in front of `urls` (llmd reads them from
    `spec`); None for a peer when the peers could not be installed."""
    if kind in ("llmd", "llmd-affinity"):
        return [sys.executable, "-m", "llmd.cli", "router", "--spec", str(spec), "--policy", arg, "--port", str(port),
                "--log-level", "WARNING"]  # fmt: skip
    if peers is None:
        return None
    # Each peer also serves Prometheus on a fixed default port (29000): a free one, so that two peers (two benchmarks
    # at once) never collide there.
    common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls, "--policy", arg,
              "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]  # fmt: skip
    if kind == "sglang":
        return [str(peers), "-m", "sglang_router.launch_router", *common, "--log-level", "warn"]
    return [str(peers.parent / "vllm-router"), *common, "--log-level", "warning"]
