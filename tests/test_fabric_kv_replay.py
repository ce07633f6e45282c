"""The KV-event replay port of a vLLM replica over two nodes whose headless node finds its layout port taken: that node
moves it to a free one on its own address, as a head does, and keeps the side channel the nodes agreed; the head's
discovery entry lists what the headless rank bound (vLLM's own publisher, run here as each node's argv configures it,
reports it on the head's /kv_event_sources)."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from fabricutil import agree
from test_fabric_side_channel import HEAD, OTHER, head_entry, pd_spec

from llmd.engines.vllm_server import port_free
from llmd.fabric.bootstrap import _bind_first, _bound_entry, _dp_ranks
from llmd.fabric.plan import EngineProcess, NodePlan, plan_nodes
from llmd.fabric.side_channel import ENV, published_ports
from llmd.kv.events import is_replay_end, replay_request


@dataclass
class Replica:
    base: int  # the decode pool's layout port: rank r's replay is base + 3000 + r
    agreed: list[NodePlan]  # the plans once the nodes agreed on their probed ports
    head: EngineProcess  # each as _bind_first hands it to vLLM
    headless: EngineProcess


def kv_config(proc: EngineProcess) -> dict[str, Any]:
    return json.loads(proc.argv[proc.argv.index("--kv-events-config") + 1])


def other_flags(proc: EngineProcess) -> list[str]:
    """`proc`'s argv without its KV-events config."""
    i = proc.argv.index("--kv-events-config")
    return proc.argv[:i] + proc.argv[i + 2 :]


@contextmanager
def squatted_headless_replay() -> Iterator[int]:
    """A decode base port P whose headless rank 1's replay port (P + 3000 + 1) another program holds on OTHER, while
    the rest of the replica's layout is free: HTTP, side channel, replay and RPC on HEAD, rank 1's side channel on
    OTHER."""
    for _ in range(50):
        squat = socket.socket()
        squat.bind((OTHER, 0))
        squat.listen()
        base = squat.getsockname()[1] - 3001
        on_head = [base, base + 2000, base + 3000, base + 5000]
        if (
            base >= 1024
            and base + 5000 < 65536
            and all(port_free(HEAD, p) for p in on_head)
            and port_free(OTHER, base + 2001)
        ):
            with squat:
                yield base
            return
        squat.close()
    raise RuntimeError("no squattable layout")


@pytest.fixture
def replica(tmp_path: Path) -> Iterator[Replica]:
    """Held for the test: the squatter on the headless node's layout replay port."""
    with squatted_headless_replay() as base:
        plans = plan_nodes(pd_spec(base), "decode", ["a", "b"], [HEAD, OTHER])
        agreed = agree(tmp_path, plans)
        head, headless = (plan.processes[0] for plan in agreed)
        yield Replica(base, agreed, _bind_first(head), _bind_first(headless))


def test_a_taken_headless_replay_port_moves_on_its_node_and_its_side_channel_stays(replica: Replica) -> None:
    base, agreed = replica.base, replica.agreed
    planned_head, planned_headless = (plan.processes[0] for plan in agreed)
    assert kv_config(planned_headless)["replay_endpoint"] == f"tcp://{OTHER}:{base + 3000}", "vLLM adds rank 1"
    # The headless node's replay socket is left to vLLM: a free port on its own address, reported by its head.
    assert kv_config(replica.headless)["replay_endpoint"] == "tcp://*:0"
    assert replica.headless.env["VLLM_HOST_IP"] == OTHER
    # Nothing else of it moves: its side channel was agreed and is published by the head, and it serves no HTTP.
    assert replica.headless.env == planned_headless.env
    assert other_flags(replica.headless) == other_flags(planned_headless)
    assert int(replica.headless.env[ENV]) == base + 2000, "the layout's: free on OTHER at rank 1"
    # The head's ports are free on HEAD: kept.
    assert replica.head == planned_head
    entry = head_entry(agreed)
    assert entry.side_channel_ports == (base + 2000, base + 2001)
    assert published_ports(entry, replica.head.env, _dp_ranks(replica.head)) == [base + 2000, base + 2001]
    # Taken since the nodes agreed, it still stays: the head publishes the agreed port, so vLLM there fails with
    # EADDRINUSE rather than listen where no peer looks (llmd.fabric.settle).
    with socket.socket() as squat:
        squat.bind((OTHER, base + 2001))
        squat.listen()
        assert _bind_first(planned_headless).env[ENV] == str(base + 2000)


@contextmanager
def kv_event_sources(sources: dict[int, Any]) -> Iterator[int]:
    """A server answering /kv_event_sources as vLLM 0.32's API server does (FastAPI's encoding of the engine client's
    dict of KVEventsConfig by DP rank), on HEAD; its port."""
    from fastapi.encoders import jsonable_encoder

    body = json.dumps(jsonable_encoder(sources)).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/kv_event_sources" else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer((HEAD, 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_the_head_publishes_the_replay_port_its_headless_rank_bound(
    replica: Replica, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each rank's publisher as vLLM's engine core makes it (EventPublisherFactory: the global DP rank, the node's
    config and VLLM_HOST_IP); in head-headless DP the head's engine client collects every rank's resolved config from
    its ready message, the headless node's included, and serves them on /kv_event_sources."""
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    from vllm.config.kv_events import KVEventsConfig

    publishers: dict[int, Any] = {}
    try:
        for proc in (replica.head, replica.headless):
            monkeypatch.setenv("VLLM_HOST_IP", proc.env["VLLM_HOST_IP"])
            config = KVEventsConfig(**kv_config(proc))
            for rank in _dp_ranks(proc):
                publishers[rank] = kv_events.EventPublisherFactory.create(config, rank)
        sources = {rank: p.get_publisher_config() for rank, p in publishers.items()}
        with kv_event_sources(sources) as port:
            entry = _bound_entry(replica.head, head_entry(replica.agreed), port)  # as the head's node publishes it
        replay = entry.kv_events_replay_endpoints
        assert replay[0] == f"tcp://{HEAD}:{replica.base + 3000}", "the head's free layout port, + rank 0"
        host, port = replay[1].removeprefix("tcp://").rsplit(":", 1)
        assert host == OTHER and int(port) != replica.base + 3001, "a free port on the headless node's address"
        assert entry.side_channel_ports == (replica.base + 2000, replica.base + 2001), "as agreed"
        # The router fills a gap in rank 1's stream from the address the entry gives: the publisher answers there.
        assert entry.replay_address(1) == replay[1]
        assert replay_answers(replay[1])
    finally:
        for p in publishers.values():
            p.shutdown()


def replay_answers(address: str) -> bool:
    """Whether a replay request to `address` gets the end marker back (nothing is buffered yet)."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(address)
        sock.send_multipart(replay_request(0))
        return bool(sock.poll(5000)) and is_replay_end(sock.recv_multipart())
    finally:
        sock.close(linger=0)
        ctx.term()
