"""Fixtures of the conformance suite: one tiny model, one simulated engine and one real vLLM CPU server per session.

Both servers run as child processes on 127.0.0.1 with the same served name, block size, max_model_len and prefix
caching hash (sha256, no PYTHONHASHSEED), KV events on an ipc:// PUB socket plus a tcp replay socket. The `engine`
fixture is parametrized over both; tests that need both at once take `both` (and carry the `vllm` marker).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import zmq

from llmd.engines.vllm_server import log_tail, stop_process_group, wait_healthy
from llmd.kv.events import is_replay_end, replay_request

BLOCK_SIZE = 32  # vLLM's CPU attention wants a multiple of 32
MAX_MODEL_LEN = 1024
SERVED_NAME = "tiny"
HASH_ALGO = "sha256"
KV_TOPIC = "kv"
HTTP_TIMEOUT_S = 60.0
SIM_START_TIMEOUT_S = 60.0
VLLM_START_TIMEOUT_S = 240.0

ENGINE_PARAMS = ["sim", pytest.param("vllm", marks=pytest.mark.vllm)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Response:
    status: int
    headers: dict[str, str]  # lower-cased names
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return json.loads(self.body)

    def sse(self) -> list[Any]:
        """The data payloads of a server-sent event stream, "[DONE]" kept as the string."""
        out: list[Any] = []
        for block in self.text.split("\n\n"):
            if not block.strip():
                continue
            assert block.startswith("data: "), f"not an SSE data event: {block!r}"
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
        return out


@dataclass
class Server:
    """One running engine server and a small synchronous client for it."""

    name: str  # "sim" or "vllm"
    url: str
    replay_endpoint: str
    pub_endpoint: str
    model_dir: Path
    log: Path
    proc: subprocess.Popen
    sub: zmq.Socket | None = None  # subscribed to the PUB endpoint from start-up on
    extra: dict[str, Any] = field(default_factory=dict)

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        raw: bytes | None = None,
        content_type: str | None = "application/json",
        timeout: float = HTTP_TIMEOUT_S,
        headers: dict[str, str] | None = None,
    ) -> Response:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        sent = {"Content-Type": content_type} if content_type and data is not None else {}
        sent.update(headers or {})
        req = urllib.request.Request(self.url + path, data=data, headers=sent, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return Response(resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read())
        except urllib.error.HTTPError as exc:
            return Response(exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read())

    def get(self, path: str, **kw: Any) -> Response:
        return self.request("GET", path, **kw)

    def post(self, path: str, body: Any = None, **kw: Any) -> Response:
        return self.request("POST", path, body, **kw)

    def ok(self, path: str, body: Any) -> Any:
        """POST that must succeed; the parsed JSON body."""
        resp = self.post(path, body)
        assert resp.status == 200, f"{self.name} {path} {body!r:.200} -> {resp.status} {resp.text[:500]}"
        return resp.json()

    # ---- KV events ---------------------------------------------------------------------------------------------------
    def replay(self, start_seq: int = 0, timeout_s: float = 10.0) -> list[list[bytes]]:
        """Every buffered batch `[topic, seq, payload]` from start_seq on, via the publisher's ROUTER replay socket."""
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        try:
            sock.send_multipart(replay_request(start_seq))
            out: list[list[bytes]] = []
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if not sock.poll(200):
                    continue
                frames = sock.recv_multipart()
                if is_replay_end(frames):
                    return out
                parts = frames[1:] if len(frames) == 4 and frames[0] == b"" else frames
                out.append(list(parts))
            raise TimeoutError(f"{self.name}: replay from {self.replay_endpoint} did not end in {timeout_s} s")
        finally:
            sock.close()

    def next_seq(self) -> int:
        batches = self.replay(0)
        return int.from_bytes(batches[-1][1], "big") + 1 if batches else 0

    def drain_sub(self) -> list[list[bytes]]:
        """Every frame set the live subscriber has queued so far."""
        out: list[list[bytes]] = []
        assert self.sub is not None
        while self.sub.poll(100):
            out.append(self.sub.recv_multipart())
        return out

    def metrics_text(self) -> str:
        resp = self.get("/metrics")
        assert resp.status == 200, resp.text[:300]
        return resp.text


def _subscriber(endpoint: str) -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVHWM, 100_000)
    sub.setsockopt(zmq.SUBSCRIBE, KV_TOPIC.encode())
    sub.connect(endpoint)
    return sub


def _have_vllm() -> bool:
    from llmd.engines.vllm_deploy import vllm_installed

    return vllm_installed()


def _child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}  # sha256 with the fixed NONE_HASH seed
    env.update(HF_HUB_OFFLINE="1", **extra)
    return env


@pytest.fixture(scope="session")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("conformance")


@pytest.fixture(scope="session")
def tiny_model(workdir: Path) -> Path:
    from llmd.models.tiny import make_tiny

    return make_tiny(workdir / "tiny", weights=True)


@pytest.fixture(scope="session")
def sim_server(tiny_model: Path, workdir: Path) -> Iterator[Server]:
    """`llmd engine sim` as a child process, configured as the vLLM server below."""
    replay = f"tcp://127.0.0.1:{free_port()}"
    pub = f"ipc://{workdir}/kv-sim.ipc"
    log = workdir / "sim.log"
    cmd = [
        sys.executable,
        "-m",
        "llmd.cli",
        "engine",
        "sim",
        "--model",
        str(tiny_model),
        "--served-name",
        SERVED_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--block-size",
        str(BLOCK_SIZE),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--time-scale",
        "0",
        "--kv-events-endpoint",
        pub,
        "--kv-events-replay-endpoint",
        replay,
        "--kv-events-topic",
        KV_TOPIC,
        "--no-side-channel",
        "--log-level",
        "WARNING",
    ]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, env=_child_env(), stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    sub: zmq.Socket | None = None
    try:
        # --port 0: the server prints the URL it really bound.
        url = None
        deadline = time.monotonic() + SIM_START_TIMEOUT_S
        while url is None and time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"sim exited with code {proc.returncode}:\n{log_tail(log)}")
            m = re.search(r"serving \S+ on (http://127\.0\.0\.1:\d+)", log.read_text(errors="replace"))
            url = m.group(1) if m else None
            if url is None:
                time.sleep(0.1)
        if url is None:
            raise RuntimeError(f"sim did not report its URL in {SIM_START_TIMEOUT_S} s:\n{log_tail(log)}")
        wait_healthy(url + "/health", proc, SIM_START_TIMEOUT_S, log, name="sim")
        sub = _subscriber(pub)
        yield Server("sim", url, replay, pub, tiny_model, log, proc, sub)
    finally:
        stop_process_group(proc)
        if sub is not None:
            sub.close()


@pytest.fixture(scope="session")
def vllm_server(tiny_model: Path, workdir: Path) -> Iterator[Server]:
    """A real vLLM CPU server (`python -m vllm.entrypoints.openai.api_server`) on the tiny model."""
    if not _have_vllm():
        if os.environ.get("LLMD_REQUIRE_VLLM") == "1":  # make test: vLLM's absence is a failure, not a skip
            pytest.fail("vllm is not installed but LLMD_REQUIRE_VLLM=1 (make test installs it: make install-full)")
        pytest.skip("vllm is not installed (pip install -e '.[vllm]')")
    from llmd.engines.vllm_server import vllm_command

    port = free_port()
    replay = f"tcp://127.0.0.1:{free_port()}"
    pub = f"ipc://{workdir}/kv-vllm.ipc"
    log = workdir / "vllm.log"
    events_cfg = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": pub,
        "replay_endpoint": replay,
        "topic": KV_TOPIC,
        "buffer_steps": 100_000,
    }
    args = [
        "--served-model-name",
        SERVED_NAME,
        "--block-size",
        str(BLOCK_SIZE),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--enable-prefix-caching",
        "--prefix-caching-hash-algo",
        HASH_ALGO,
        "--enable-prompt-tokens-details",
        "--gpu-memory-utilization",
        "0.2",
        "--enforce-eager",
        "--kv-events-config",
        json.dumps(events_cfg),
    ]
    env = _child_env(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES="1")
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            vllm_command(str(tiny_model), port, args),
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    sub: zmq.Socket | None = None
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url + "/health", proc, VLLM_START_TIMEOUT_S, log, name="vLLM")
        sub = _subscriber(pub)
        yield Server("vllm", url, replay, pub, tiny_model, log, proc, sub)
    finally:
        stop_process_group(proc)
        if sub is not None:
            sub.close()


@pytest.fixture(scope="session", params=ENGINE_PARAMS)
def engine(request: pytest.FixtureRequest) -> Server:
    """Each test that takes `engine` runs once against the simulated engine and once against real vLLM."""
    return request.getfixturevalue(f"{request.param}_server")


@pytest.fixture(scope="session")
def both(sim_server: Server, vllm_server: Server) -> dict[str, Server]:
    return {"sim": sim_server, "vllm": vllm_server}


@pytest.fixture(scope="session")
def observe() -> Any:
    """Memoized scenarios: `observe(scenario, server)` runs a scenario once per server and session, so a per-engine
    test and a sim-vs-vLLM test look at the same observation (a rerun would hit the prefix cache and differ)."""
    cache: dict[tuple[Any, ...], Any] = {}

    def get(scenario: Any, server: Server, *args: Any) -> Any:
        key = (scenario.__name__, args, server.name)
        if key not in cache:
            cache[key] = scenario(server, *args)
        return cache[key]

    return get
