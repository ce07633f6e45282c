"""Ports on shared nodes, as a user meets them: a foreign server squatting the spec's router and engine ports gets no
request (the launched components take free ports, publish them, and the client follows what was published); `port:
auto` engines are routed to through the ports in the discovery file; a health check that reaches a server of someone
else's says so, naming the port and what answered; every listener is loopback unless the spec says otherwise."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import aiohttp
import pytest
import yaml
from netutil import listening

from llmd import runid
from llmd.discovery import read_discovery
from llmd.engines.vllm_server import EngineStartError, wait_healthy

ROOT = Path(__file__).resolve().parent.parent


class Squatter:
    """Someone else's HTTP server on a port: answers 200 to everything and counts what it was sent."""

    def __init__(self, port: int = 0) -> None:
        hits: list[str] = []

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                hits.append(f"{self.command} {self.path}")
                body = b'{"hello": "not llmd"}'
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.hits = hits
        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def squatters() -> Iterator[list[Squatter]]:
    made: list[Squatter] = []
    yield made
    for s in made:
        s.close()


def test_a_squatted_router_and_engine_port_get_no_request(
    tmp_path: Path, model_dir: Path, squatters: list[Squatter], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launched het job's path on one machine: engine_task starts the engine, run_main the router and client."""
    from launchers.main_job import run_main
    from launchers.runstate import read_state

    router_squat, engine_squat = Squatter(), Squatter()
    squatters += [router_squat, engine_squat]
    spec = {
        "name": "squat",
        "model": {"path": str(model_dir)},
        "prefill": {"nodes": 0},
        # The spec's own ports are the ones someone else already holds.
        "decode": {"port": engine_squat.port, "max_num_seqs": 8},
        "router": {"port": router_squat.port, "policy": "least-loaded"},
        "engine": {"time_scale": 0, "startup_timeout_s": 60},
        "workload": {"duration_s": 1.5, "concurrency": 2},
    }
    run_dir = tmp_path / "run"
    for sub in ("logs", "exit", "parts"):
        (run_dir / sub).mkdir(parents=True)
    spec_path = run_dir / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    (run_dir / "nodes-main.txt").write_text("localhost\n")
    ident = runid.new_run_id()
    monkeypatch.setenv(runid.ENV, ident)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LLMD_ENGINE_HOST": "127.0.0.1"}
    task = ["-m", "launchers.engine_task", "--spec", str(spec_path), "--run-dir", str(run_dir), "--role", "decode"]
    with open(run_dir / "logs" / "decode-0.log", "wb") as log:
        engine = subprocess.Popen(
            [sys.executable, *task, "--node-index", "0"], env=env, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        assert run_main(spec_path, run_dir) == 0, (run_dir / "logs" / "decode-0.log").read_text()
    finally:
        engine.terminate()
        engine.wait(timeout=10)
    state = read_state(run_dir)
    entry = read_discovery(run_dir / "discovery.json")[0]
    # The engine moved off the taken port and published where it went; the router did the same, in run.json.
    assert entry.url != engine_squat.url and entry.url.startswith("http://127.0.0.1:")
    assert state["router"]["url"] != router_squat.url
    assert state["run_id"] == ident
    assert state["state"] == "COMPLETED" and state["progress"]["requests"] > 0
    assert router_squat.hits == [] and engine_squat.hits == []


def test_auto_ports_are_published_and_routed_to(model_dir: Path) -> None:
    """Engines of a `port: auto` pool (two DP ranks each: every rank's ports its own) bind free ports and report
    them; the router, given only the discovery entries, routes to them and hears their KV events."""
    from llmd.demo import _pod_of
    from llmd.engines.sim.server import SimEngineGroup
    from llmd.engines.sim.server_config import SimServerConfig
    from llmd.router.proxy import Router, RouterConfig
    from llmd.spec import DeploymentSpec
    from llmd.spec.layout import engine_endpoints

    spec = DeploymentSpec.model_validate(
        {
            "model": {"path": str(model_dir)},
            "prefill": {"nodes": 0},
            "decode": {"port": "auto", "dp_size": 2, "gpus_per_node": 2},
        }
    )
    ep = engine_endpoints(spec)[0]
    assert (ep.http_port, ep.kv_events_port, ep.replay_port, ep.side_channel_port) == (0, 0, 0, 0)
    ident = runid.new_run_id()
    config = SimServerConfig.from_spec(
        spec,
        "decode",
        name=ep.name,
        kv_events_endpoint=ep.kv_events_endpoint(),
        kv_events_replay_endpoint=ep.replay_endpoint(),
        side_channel_port=ep.side_channel_port,
        time_scale=0,
        run_id=ident,
    )

    async def body() -> None:
        async with SimEngineGroup([config]) as group:
            pod = _pod_of(group[0])
            bound = group[0].bound_ports()
            assert pod.url == group[0].url and bound["http_port"] != 0
            assert len(set(pod.kv_events_endpoints)) == 2 and len(set(pod.side_channel_ports)) == 2
            rc = RouterConfig.from_spec(spec, port=0, host="127.0.0.1", health_interval_s=0.2, metrics_interval_s=0)
            async with Router(rc, [pod], run_id=ident) as router:
                for _ in range(50):
                    if router.registry.healthy():
                        break
                    await asyncio.sleep(0.1)
                async with aiohttp.ClientSession() as http:
                    for rank in (0, 1):
                        body = {"model": spec.model.served_name, "prompt": "hello " * 40, "max_tokens": 2}
                        async with http.post(
                            f"{router.url}/v1/completions", json=body, headers={"X-data-parallel-rank": str(rank)}
                        ) as r:
                            assert r.status == 200, await r.text()
                            assert r.headers["x-llmd-pod"] == "decode-0"
                    async with http.get(f"{router.url}/health") as r:
                        assert r.headers[runid.HEADER] == ident
                for _ in range(50):
                    if router.hub.stats.batches > 0:
                        break
                    await asyncio.sleep(0.1)
                assert router.hub.stats.batches > 0  # the KV events arrived on the published per-rank ports

    asyncio.run(body())


def test_a_health_check_against_a_listener_that_does_not_speak_http_waits_and_names_its_answer() -> None:
    """Bytes that are not HTTP (another protocol's banner, or a probe's own request read back when a connect to a
    free ephemeral port meets itself) are "not yet", never an exception out of the waiter: on a fabric rank that
    was a traceback instead of the engine's outcome. The timeout's message says what answered."""
    import socket

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(16)
        port = srv.getsockname()[1]
        stop = threading.Event()

        def banner() -> None:
            srv.settimeout(0.2)
            while not stop.is_set():
                try:
                    conn, _ = srv.accept()
                except OSError:
                    continue
                with conn:
                    conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")

        threading.Thread(target=banner, daemon=True).start()
        try:
            answer = runid.identify(f"http://127.0.0.1:{port}", "feedc0de")
            assert not answer.ok and not answer.foreign and "BadStatusLine" in answer.reason
            proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
            try:
                with pytest.raises(EngineStartError, match=r"not healthy .* after 1 s \(the last answer: BadStatus"):
                    wait_healthy(f"http://127.0.0.1:{port}/health", proc, 1, name="decode-0", run_id="feedc0de")
            finally:
                proc.kill()
                proc.wait()
        finally:
            stop.set()


def test_a_health_check_against_a_foreign_server_names_it(squatters: list[Squatter]) -> None:
    squat = Squatter()
    squatters.append(squat)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(EngineStartError) as err:
            wait_healthy(f"{squat.url}/health", proc, 10, name="router", run_id="feedc0de")
    finally:
        proc.kill()
        proc.wait()
    message = str(err.value)
    print(message)
    assert f"something else is listening on 127.0.0.1:{squat.port}" in message
    assert "its /health did not answer with this run's id" in message and "not llmd" in message
    assert "it is not this run's router" in message
    # `llmd bench --run-id` refuses in the same words before sending any load.
    from llmd.errors import UserError
    from llmd.workload.bench_cli import check_run

    with pytest.raises(UserError, match=f"something else is listening on 127.0.0.1:{squat.port}"):
        check_run(squat.url, "feedc0de")
    assert [h for h in squat.hits if "completions" in h] == []


def test_the_router_keeps_foreign_and_other_runs_pods_out(model_dir: Path, squatters: list[Squatter]) -> None:
    from llmd.discovery import PodInfo
    from llmd.engines.sim.server import SimEngineGroup
    from llmd.engines.sim.server_config import SimServerConfig
    from llmd.router.endpoints import EndpointRegistry

    squat = Squatter()
    squatters.append(squat)

    async def body() -> None:
        other = SimServerConfig(model_dir=str(model_dir), side_channel_port=None, run_id="0ther0run", name="x")
        async with SimEngineGroup([other]) as group, aiohttp.ClientSession() as http:
            pods = [PodInfo("foreign", "decode", squat.url), PodInfo("other", "decode", group.urls[0])]
            reg = EndpointRegistry(pods, run_id="feedc0de", metrics_interval_s=0)
            reasons: list[str] = []
            import logging

            class Catch(logging.Handler):
                def emit(self, record: logging.LogRecord) -> None:
                    reasons.append(record.getMessage())

            log = logging.getLogger("llmd.router.endpoints")
            handler = Catch()
            log.addHandler(handler)
            try:
                await reg.start(http)
                await reg.check_all()  # a second round: still out, and the reason said once
            finally:
                log.removeHandler(handler)
                await reg.stop()
            assert reg.healthy() == []
            text = "\n".join(reasons)
            print(text)
            assert f"something else is listening on 127.0.0.1:{squat.port}" in text
            assert "another run ('0ther0run')" in text
            assert text.count(f"127.0.0.1:{squat.port}") == 1

    asyncio.run(body())


def test_default_listeners_are_loopback(tmp_path: Path, model_dir: Path) -> None:
    """A router started as the main job starts it, and a sim engine as engine_task starts it (on the loopback
    address, as a single-node run gives it), listen on 127.0.0.1 only; so do the engine's KV and side-channel ports."""
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump({"model": {"path": str(model_dir)}, "decode": {"port": "auto"}}))
    ports_file, router_file = tmp_path / "ports.json", tmp_path / "router.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), runid.ENV: "feedc0de"}
    sim = ["engine", "sim", "--spec", str(spec_path), "--role", "decode", "--side-channel-port", "0"]
    sim += ["--kv-events-endpoint", "tcp://*:0", "--kv-events-replay-endpoint", "tcp://*:0"]
    engine = subprocess.Popen(
        [sys.executable, "-m", "llmd.cli", *sim, "--ports-file", str(ports_file)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    routing = ["router", "--spec", str(spec_path), "--discovery", str(tmp_path / "d.json")]
    router = subprocess.Popen(
        [sys.executable, "-m", "llmd.cli", *routing, "--port-file", str(router_file)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for path, proc in ((ports_file, engine), (router_file, router)):
            for _ in range(300):
                if path.exists() or proc.poll() is not None:
                    break
                import time

                time.sleep(0.1)
            assert path.exists(), f"{proc.args} exited {proc.poll()}"
        bound = json.loads(ports_file.read_text())
        ports = [bound["http_port"], json.loads(router_file.read_text())["port"], *bound["side_channel_ports"]]
        ports += [int(e.rpartition(":")[2]) for e in bound["kv_events_endpoints"] + bound["kv_events_replay_endpoints"]]
        for port in ports:
            assert listening(port) == {"127.0.0.1"}, port
    finally:
        for proc in (engine, router):
            proc.terminate()
            proc.wait(timeout=10)
