"""Learning the ports a real vLLM bound, without vLLM: the /proc reader against real listening sockets, the HTTP port
found among a process's sockets and confirmed by the run id, the ports moved off taken ones before a start, and the
vLLM command lines of a `port: auto` pool. Real servers: tests/vllm_stack/test_ports_vllm.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from llmd.engines import vllm_server
from llmd.engines.vllm import vllm_launches
from llmd.engines.vllm_server import (
    address_in_use,
    choose_bases,
    listening_ports,
    move_taken_ports,
    wait_bound_http,
)
from llmd.spec.model import DeploymentSpec

pytestmark = pytest.mark.skipif(not Path("/proc/self/net/tcp").exists(), reason="reads /proc (Linux)")


def test_listening_ports_finds_our_own_sockets_and_only_listening_ones() -> None:
    with socket.socket() as lis, socket.socket() as bound, socket.socket(socket.AF_INET6) as lis6:
        lis.bind(("127.0.0.1", 0))
        lis.listen()
        bound.bind(("127.0.0.1", 0))  # bound, not listening: not a server's port yet
        lis6.bind(("::1", 0))
        lis6.listen()
        got = listening_ports(os.getpid())
        assert ("127.0.0.1", lis.getsockname()[1]) in got
        assert ("::1", lis6.getsockname()[1]) in got
        assert all(port != bound.getsockname()[1] for _, port in got)


def test_listening_ports_of_another_process_and_of_none() -> None:
    with socket.socket() as other:  # ours: must not be reported as the child's
        other.bind(("127.0.0.1", 0))
        other.listen()
        child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import socket,sys,time; s=socket.socket(); s.bind(('127.0.0.1',0)); s.listen();"
                "print(s.getsockname()[1], flush=True); time.sleep(30)",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            port = int(child.stdout.readline())
            assert listening_ports(child.pid) == [("127.0.0.1", port)]
        finally:
            child.kill()
            child.wait()
    assert listening_ports(child.pid) == []


def test_wait_bound_http_finds_the_server_among_other_sockets() -> None:
    """A stand-in for `--port 0`: a child with a non-HTTP listener and an HTTP server on ports it picked itself."""
    code = (
        "import socket; from http.server import BaseHTTPRequestHandler, HTTPServer\n"
        "junk = socket.socket(); junk.bind(('127.0.0.1', 0)); junk.listen()\n"
        "class H(BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.send_header('Content-Length', '0'); self.end_headers()\n"
        "    def log_message(self, *a): pass\n"
        "HTTPServer(('127.0.0.1', 0), H).serve_forever()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        port = wait_bound_http(child, "127.0.0.1", 20.0)
        assert ("127.0.0.1", port) in listening_ports(child.pid)
        assert len(listening_ports(child.pid)) == 2
    finally:
        child.kill()
        child.wait()


def _spec(tmp_path: Path, port: object, **kw: object) -> DeploymentSpec:
    data = {
        "model": {"path": str(tmp_path), "block_size": 32, "max_model_len": 1024},
        "prefill": {"nodes": 1, "port": port},
        "decode": {"nodes": 1, "port": port},
        "engine": {"kind": "vllm"},
        **kw,
    }
    return DeploymentSpec.model_validate(data)


def test_move_taken_ports_moves_only_what_is_taken(tmp_path: Path) -> None:
    with socket.socket() as squat:
        squat.bind(("127.0.0.1", 0))
        squat.listen()
        taken = squat.getsockname()[1]
        launch = next(x for x in vllm_launches(_spec(tmp_path, taken)) if x.role == "prefill")
        argv, env = move_taken_ports(launch.argv, launch.env, "127.0.0.1")
    assert argv[argv.index("--port") + 1] == "0"
    config = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert config["replay_endpoint"].endswith(f":{taken + 3000}")  # free: kept
    assert config["endpoint"] == "tcp://*:0"  # the PUB socket always takes a free port on VLLM_HOST_IP
    # After an EADDRINUSE exit every port moves; the side channel to a probed free one (vLLM cannot take 0 there).
    argv, env = move_taken_ports(launch.argv, {"VLLM_NIXL_SIDE_CHANNEL_PORT": "1"}, "127.0.0.1", every=True)
    config = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert config["endpoint"] == config["replay_endpoint"] == "tcp://*:0"
    assert env["VLLM_HOST_IP"] == "127.0.0.1"
    assert int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) > 1


def test_ports_chosen_together_never_coincide(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel that offers the same free port again (a probe binds and closes it) still gives two processes two
    bands, and a band moved off a taken port misses the ports another process keeps."""
    offered = iter([40000, 40000, 40000, 40010, 40000, 40020])

    class Probe:
        def __enter__(self) -> Probe:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def bind(self, address: tuple[str, int]) -> None:
            self.port = address[1] or next(offered)

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(vllm_server.socket, "socket", Probe)
    monkeypatch.setattr(vllm_server, "port_free", lambda host, port: port != 30001)
    # Two side channels of ranks 0-1 and one RPC port, all `port: auto`: 40000-40001, 40010-40011, then 40020.
    assert choose_bases("127.0.0.1", [(0, [0, 1]), (0, [0, 1]), (0, [0])]) == [40000, 40010, 40020]
    offered = iter([40000, 40010])
    # 30000 is taken at rank 1 (30001): it moves, and not onto 40000, which the next process keeps.
    assert choose_bases("127.0.0.1", [(30000, [0, 1]), (40000, [0])]) == [40010, 40000]
    offered = iter([40001, 40005])
    # A headless node's ranks 2-3: the band of two free ports starts at base + 2.
    assert choose_bases("127.0.0.1", [(0, [2, 3])]) == [40001 - 2]


def test_auto_pool_lets_vllm_bind(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "auto")
    for launch in vllm_launches(spec, head_addresses={("prefill", 0): "10.0.0.1", ("decode", 0): "10.0.0.2"}):
        argv = launch.argv
        assert argv[argv.index("--port") + 1] == "0"
        assert launch.http_port == 0
        config = json.loads(argv[argv.index("--kv-events-config") + 1])
        assert config["endpoint"] == config["replay_endpoint"] == "tcp://*:0"
        assert launch.env["VLLM_HOST_IP"] in ("10.0.0.1", "10.0.0.2")


def test_address_in_use(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_text("ERROR ... OSError: [Errno 98] Address already in use\n")
    assert address_in_use(log)
    log.write_text("ok\n")
    assert not address_in_use(log)
