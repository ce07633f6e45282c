"""A real vLLM decode server whose spec ports (HTTP and KV events) a foreign listener holds: it binds free ones, its
PodInfo names them, the router routes a request there and gets the server's KV events, and the squatter gets nothing."""

from __future__ import annotations

import asyncio
import socket
import threading
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import pytest
from vllmutil import post_async, process_tree, require_vllm, router_config, run_bounded, until_ready

from llmd.engines.vllm_deploy import VllmDeployment, with_free_ports
from llmd.engines.vllm_server import listening_ports
from llmd.router.proxy import Router
from llmd.spec.layout import KV_EVENTS_OFFSET
from llmd.spec.model import DeploymentSpec

pytestmark = [pytest.mark.vllm, pytest.mark.integration]


class Squatter:
    """Listens on a port and counts the connections it accepts."""

    def __init__(self, port: int) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen()
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


def test_squatted_decode_ports_move_and_the_run_completes(dense_model: Path, tmp_path: Path) -> None:
    require_vllm()
    spec = with_free_ports(
        DeploymentSpec.model_validate(
            {
                "name": "vllm-ports",
                "model": {"path": str(dense_model), "served_name": "tiny", "block_size": 32, "max_model_len": 512},
                "prefill": {"nodes": 0},
                "decode": {"nodes": 1, "max_num_seqs": 4},
                "kv": {"gpu_blocks": 40},
                "engine": {"kind": "vllm"},
                "router": {"p2p": False},
            }
        )
    )
    base = spec.decode.port
    squatters = [Squatter(base), Squatter(base + KV_EVENTS_OFFSET)]
    try:
        with VllmDeployment(spec, tmp_path / "logs", timeout_s=480) as dep:
            (pod,) = dep.pods
            assert urlsplit(pod.url).port != base, pod
            assert not pod.kv_events_endpoint.endswith(f":{base + KV_EVENTS_OFFSET}"), pod
            assert pod.kv_events_endpoint.startswith("tcp://127.0.0.1:"), pod  # as vLLM bound it
            # Nothing of the server listens on every interface: the API, the KV-event PUB and replay sockets all
            # bind the node's own address (here 127.0.0.1), in the API server and in its engine core alike.
            (proc,) = dep.processes
            listeners = [(pid, a) for pid in process_tree(proc.proc.pid) for a in listening_ports(pid)]
            assert listeners and all(addr == "127.0.0.1" for _, (addr, _) in listeners), listeners
            ports = {port for _, (_, port) in listeners}
            assert int(pod.kv_events_endpoint.rsplit(":", 1)[1]) in ports

            async def routed() -> None:
                async with Router(router_config(dep, "precise"), dep.pods) as router:
                    await until_ready(router, 1)
                    body = {"model": "tiny", "prompt": "one two three " * 30, "max_tokens": 2, "temperature": 0}
                    async with aiohttp.ClientSession() as http:
                        _, data = await post_async(http, router.url + "/v1/completions", body, "s")
                    assert data["choices"][0]["text"] is not None
                    # The server's KV events reach the router from the port vLLM bound.
                    for _ in range(100):
                        if len(router.index) > 0:
                            break
                        await asyncio.sleep(0.1)
                    assert len(router.index) > 0

            run_bounded(routed())
        assert [s.accepted for s in squatters] == [0, 0]
    finally:
        for s in squatters:
            s.close()
