"""The router's view of the engine pods: where they are (the spec's layout or the discovery file engines write, see
llmd.discovery), whether they are alive (/health every second) and how loaded they are (a cheap poll of vLLM's
/metrics gauges).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import aiohttp

from llmd import runid
from llmd.discovery import PodInfo, rank_address, read_discovery
from llmd.errors import UserError
from llmd.router.pods import Pod

log = logging.getLogger(__name__)
__all__ = ["EndpointRegistry", "parse_engine_gauges", "pods_from_spec"]

# vLLM's gauges the router reads; labelled by `engine` = the DP rank.
_GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
}
_READ = (*_GAUGES, "vllm:cache_config_info")  # the series parse_engine_gauges reads


# ---- where pods come from --------------------------------------------------------------------------------------------


def pods_from_spec(spec: Any, host: str = "127.0.0.1") -> list[PodInfo]:
    """Every engine of a DeploymentSpec at the layout's ports (llmd.spec.layout)."""
    from llmd.spec.layout import engine_endpoints

    pods = []
    for ep in engine_endpoints(spec, host):
        pods.append(
            PodInfo(
                name=ep.name,
                role=ep.role,
                url=ep.url,
                dp_size=ep.dp_size,
                kv_events_endpoint=f"tcp://{host}:{ep.kv_events_port}",
                kv_events_replay_endpoint=ep.replay_endpoint(bind=False),
                side_channel_host=host,
                side_channel_port=ep.side_channel_port,
                engine_id=ep.engine_id,
            )
        )
    return pods


# ---- the registry ----------------------------------------------------------------------------------------------------

Listener = Callable[["Pod"], None]


class EndpointRegistry:
    """The live set of pods: static ones, or a discovery file's, kept healthy-or-not by a health loop.

    Listeners hear about every transition at once (on_up when a pod becomes healthy, on_down when it stops being so
    or leaves the set), so the proxy can take a dead pod out of routing and the index in the same step.
    """

    def __init__(
        self,
        pods: Iterable[PodInfo] = (),
        *,
        discovery: str | os.PathLike[str] | None = None,
        health_interval_s: float = 1.0,
        health_timeout_s: float = 1.0,
        metrics_interval_s: float = 1.0,
        discovery_interval_s: float = 0.5,
        slow_strikes: int = 3,
        run_id: str | None = None,
    ) -> None:
        # Given a run id (llmd.runid), a pod is healthy only when it proves it belongs to the run: whatever else
        # answers at its address (a stale engine, another user's server on a shared node) is kept out of routing.
        self.run_id = run_id
        self.pods: dict[str, Pod] = {p.name: Pod(p) for p in pods}
        self.discovery = Path(discovery) if discovery is not None else None
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.metrics_interval_s = metrics_interval_s
        self.discovery_interval_s = discovery_interval_s
        self.slow_strikes = slow_strikes
        self.on_up: list[Listener] = []
        self.on_down: list[Listener] = []
        self.on_change: list[Callable[[], None]] = []  # any change of the routable set
        self._mtime: float | None = None
        self._http: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.version = 0  # bumped on every change of the routable set (snapshot caches key on it)
        self.discovery_errors = 0

    # -- lifecycle
    async def start(self, http: aiohttp.ClientSession) -> None:
        self._http = http
        if self.discovery is not None:
            self.reload_discovery()
        await self.check_all()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._health_loop(), name="router-health")]
        if self.metrics_interval_s > 0:
            self._tasks.append(loop.create_task(self._metrics_loop(), name="router-engine-metrics"))
        if self.discovery is not None:
            self._tasks.append(loop.create_task(self._discovery_loop(), name="router-discovery"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []

    # -- queries
    def get(self, name: str) -> Pod | None:
        return self.pods.get(name)

    def healthy(self) -> list[Pod]:
        return [p for p in self.pods.values() if p.healthy]

    # -- transitions
    def _changed(self) -> None:
        self.version += 1
        for cb in self.on_change:
            cb()

    def mark_up(self, pod: Pod) -> None:
        if pod.healthy or self.pods.get(pod.name) is not pod:
            return
        pod.healthy = True
        pod.failures = 0
        pod.last_change = time.monotonic()
        log.info("pod %s (%s) is up", pod.name, pod.info.url)
        for cb in self.on_up:
            cb(pod)
        self._changed()

    def mark_down(self, name: str, reason: str = "") -> None:
        """Out of routing at once; the health loop brings it back when /health answers again."""
        pod = self.pods.get(name)
        if pod is None or not pod.healthy:
            return
        pod.healthy = False
        pod.last_change = time.monotonic()
        pod.clear_load()
        log.warning("pod %s is down%s", name, f": {reason}" if reason else "")
        for cb in self.on_down:
            cb(pod)
        self._changed()

    def set_pods(self, infos: Iterable[PodInfo]) -> None:
        """Replace the pod set: removed or changed pods go down first, new ones start unhealthy (checked soon)."""
        new = {p.name: p for p in infos}
        for name, pod in list(self.pods.items()):
            if new.get(name) != pod.info:
                self.mark_down(name, "removed from discovery" if name not in new else "changed in discovery")
                del self.pods[name]
        for name, info in new.items():
            if name not in self.pods:
                self.pods[name] = Pod(info)
        self._changed()

    # -- discovery
    def reload_discovery(self) -> bool:
        """Re-read the discovery file if its mtime changed; True if the pod set was replaced."""
        assert self.discovery is not None
        try:
            st = self.discovery.stat()
        except OSError:
            return False  # not written yet (or being replaced): keep what we have
        if st.st_mtime_ns == self._mtime:
            return False
        if st.st_size == 0:
            # read_discovery takes an empty file for "no engines yet"; here it is more likely a writer that truncates
            # before writing (not llmd.discovery.publish, which renames): keep the current set until it is written.
            self.discovery_errors += 1
            return False
        try:
            infos = read_discovery(self.discovery)
        except UserError as exc:
            # A half-written file: keep the current set, try again on the next change (or the next poll).
            self.discovery_errors += 1
            log.warning("%s", exc)
            return False
        self._mtime = st.st_mtime_ns
        self.set_pods(infos)
        return True

    async def _discovery_loop(self) -> None:
        while True:
            await asyncio.sleep(self.discovery_interval_s)
            try:
                if self.reload_discovery():
                    await self.check_all()
            except Exception:  # the loop must outlive any one bad read
                log.exception("discovery reload failed")

    # -- health
    async def check(self, pod: Pod) -> bool:
        """One health probe. Refused connections and error statuses take the pod down at once; timeouts only after
        `slow_strikes` in a row, because a pod too busy to answer within a second is alive, and dropping it would
        throw away its part of the index."""
        assert self._http is not None
        reason = ""
        slow = False
        try:
            async with self._http.get(
                pod.info.url + "/health", timeout=aiohttp.ClientTimeout(total=self.health_timeout_s)
            ) as r:
                body = await r.read()
                answer = runid.answers_for(r.status, r.headers.get(runid.HEADER), body, self.run_id)
                if answer is None and not pod.healthy:
                    # A 200 without the header (vLLM): /v1/models must list the run's name. Asked when the pod comes
                    # up; once up, a process that dies takes the pod down before another can answer on its port.
                    answer = await self._vouched(pod, r.status, r.headers, body)
                if answer is not None and not answer.ok:
                    foreign = runid.foreign_message(pod.info.url, answer.reason, f"engine {pod.name}")
                    reason = foreign if answer.foreign else answer.reason
                    if answer.foreign and not pod.healthy and pod.failures == 0:
                        log.warning("pod %s stays out of routing: %s", pod.name, reason)  # once, not every round
        except TimeoutError:
            reason, slow = f"/health did not answer within {self.health_timeout_s} s", True
        except (aiohttp.ClientError, OSError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
        if self.pods.get(pod.name) is not pod:
            return False  # removed meanwhile
        if not reason:
            pod.failures = 0
            if not pod.healthy:
                await self._learn_event_sources(pod)
                self.mark_up(pod)
            return True
        pod.failures += 1
        if not slow or pod.failures >= self.slow_strikes:
            self.mark_down(pod.name, reason)
        return False

    async def _vouched(self, pod: Pod, status: int, headers: Any, body: bytes) -> runid.Answer:
        assert self._http is not None and self.run_id is not None
        try:
            async with self._http.get(
                pod.info.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=self.health_timeout_s)
            ) as r:
                models = await r.json(content_type=None) if r.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            models = None
        if runid.models_vouch(models, self.run_id):
            return runid.Answer(True)
        return runid.Answer(False, True, runid.describe(status, headers, body))

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(p) for p in list(self.pods.values())))

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self.check_all()
            except Exception:
                log.exception("health round failed")

    async def _learn_event_sources(self, pod: Pod) -> None:
        """The sim (and a vLLM build exposing it) lists each rank's KV event endpoints; learn the replay ones."""
        if pod.info.kv_events_replay_endpoint is not None or pod.info.kv_events_endpoint is None:
            return
        assert self._http is not None
        try:
            async with self._http.get(
                pod.info.url + "/kv_event_sources", timeout=aiohttp.ClientTimeout(total=self.health_timeout_s)
            ) as r:
                if r.status != 200:
                    return
                data = await r.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            return
        if not isinstance(data, dict):
            return
        for rank_s, src in data.items():
            if isinstance(src, dict) and isinstance(src.get("replay_endpoint"), str):
                with contextlib.suppress(ValueError):
                    rank = int(rank_s)
                    got = rank_address(src["replay_endpoint"], 0, pod.info.host, False)
                    if got is not None:
                        pod.replay_endpoints[rank] = got[0]

    # -- load
    async def poll_metrics(self, pod: Pod) -> None:
        assert self._http is not None
        try:
            async with self._http.get(
                pod.info.url + "/metrics", timeout=aiohttp.ClientTimeout(total=self.health_timeout_s)
            ) as r:
                if r.status != 200:
                    return
                text = await r.text()
        except (aiohttp.ClientError, TimeoutError, OSError, UnicodeDecodeError):
            return
        for rank, name, value in parse_engine_gauges(text):
            if 0 <= rank < len(pod.ranks):
                setattr(pod.ranks[rank], name, value if name == "kv_usage" else int(value))

    async def _metrics_loop(self) -> None:
        while True:
            await asyncio.sleep(self.metrics_interval_s)
            try:
                await asyncio.gather(*(self.poll_metrics(p) for p in self.healthy()))
            except Exception:
                log.exception("engine metrics poll failed")


def _label(labels: str, key: str) -> str | None:
    i = labels.find(f'{key}="')
    if i < 0:
        return None
    i += len(key) + 2
    return labels[i : labels.find('"', i)]


def parse_engine_gauges(text: str) -> list[tuple[int, str, float]]:
    """(DP rank, RankState field, value) for the vLLM gauges the router reads, in the order of their lines.

    vllm:cache_config_info is an info gauge: its value is 1 and the KV capacity sits in its labels.

    The lines of those four series are found with str.find rather than by splitting the text into lines: /metrics
    holds every histogram bucket of every DP rank (~460 lines a rank, ~60,000 for a DP128 pod), and the router reads
    each pod's every second."""
    starts: list[int] = []
    for name in _READ:
        if text.startswith(name):
            starts.append(0)
        needle = "\n" + name
        i = text.find(needle)
        while i >= 0:
            starts.append(i + 1)
            i = text.find(needle, i + 1)
    starts.sort()
    out: list[tuple[int, str, float]] = []
    for i in starts:
        j = text.find("\n", i)
        _gauge_line(text[i:j] if j >= 0 else text[i:], out)
    return out


def _gauge_line(line: str, out: list[tuple[int, str, float]]) -> None:
    """One exposition line's gauge, if it is one the router reads."""
    series, _, value = line.rstrip("\r").rpartition(" ")
    name, _, labels = series.partition("{")
    if name != "vllm:cache_config_info" and name not in _GAUGES:
        return  # a longer name that starts like one of them
    rank = 0
    engine = _label(labels, "engine")
    if engine is not None:
        with contextlib.suppress(ValueError):
            rank = int(engine)
    if name == "vllm:cache_config_info":
        for key, attr in (("num_gpu_blocks", "kv_capacity_blocks"), ("num_cpu_blocks", "cpu_capacity_blocks")):
            raw = _label(labels, key)
            if raw and raw.isdigit():
                out.append((rank, attr, float(raw)))
        return
    with contextlib.suppress(ValueError):
        out.append((rank, _GAUGES[name], float(value)))
