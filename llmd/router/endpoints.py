"""The router's view of the engine pods: where they are (the spec's layout or a discovery file that launchers write),
whether they are alive (/health every second) and how loaded they are (a cheap poll of vLLM's /metrics gauges).

Discovery file: a JSON list, one entry per engine server (pod), reloaded whenever its mtime changes:

    [{"name": "decode-0", "role": "decode", "url": "http://10.0.0.5:8200", "dp_size": 1,
      "kv_events_endpoint": "tcp://*:9200", "side_channel_host": "10.0.0.5", "side_channel_port": 10200,
      "engine_id": "decode-0", "kv_events_replay_endpoint": "tcp://*:9300"}]

`kv_events_endpoint` is rank 0's endpoint as the engine was configured (rank r publishes on port + r). A `*` host means
the engine binds and the router connects to the pod's host; an explicit host is the address the router connects to,
unless the entry says `"kv_events_bind": true` (vLLM given an explicit host connects, so the router must bind there).
`engine_id` is the NixlConnector engine id (vLLM appends `_dp<rank>` when a server runs several DP ranks); without it
the router learns a pod's id from its own prefill responses, and cannot ask a pod for a P2P pull before that.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from llmd.errors import UserError
from llmd.router.scheduling.kv_demand import InflightKV

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "both")
# vLLM's gauges the router reads; labelled by `engine` = the DP rank.
_GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
}


@dataclass(frozen=True)
class PodInfo:
    """One engine server (all its DP ranks), as the spec or a discovery file describes it."""

    name: str
    role: str
    url: str
    dp_size: int = 1
    kv_events_endpoint: str | None = None  # rank 0's, as the engine was configured
    kv_events_replay_endpoint: str | None = None  # rank 0's replay ROUTER; None: ask the pod (/kv_event_sources)
    kv_events_bind: bool = False
    side_channel_host: str | None = None
    side_channel_port: int | None = None  # rank 0's; rank r answers on port + r
    engine_id: str | None = None  # the server's NixlConnector engine id (rank 0's base)

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or "127.0.0.1"

    @property
    def serves_decode(self) -> bool:
        return self.role != "prefill"

    def events_address(self, rank: int) -> tuple[str, bool] | None:
        """(ZMQ address, bind?) of rank `rank`'s KV event stream, as the router's SUB socket must use it."""
        return _rank_address(self.kv_events_endpoint, rank, self.host, self.kv_events_bind)

    def replay_address(self, rank: int) -> str | None:
        got = _rank_address(self.kv_events_replay_endpoint, rank, self.host, False)
        return got[0] if got else None

    def engine_id_of(self, rank: int) -> str | None:
        if self.engine_id is None:
            return None
        return self.engine_id if self.dp_size == 1 else f"{self.engine_id}_dp{rank}"

    def side_channel_of(self, rank: int) -> tuple[str, int] | None:
        if self.side_channel_port is None:
            return None
        return (self.side_channel_host or self.host, self.side_channel_port + rank)


def _rank_address(endpoint: str | None, rank: int, host: str, bind: bool) -> tuple[str, bool] | None:
    if not endpoint:
        return None
    if not endpoint.startswith("tcp://"):
        return endpoint, bind  # ipc:// and friends: used as given (one rank per endpoint)
    base, _, port = endpoint.rpartition(":")
    addr_host = base[len("tcp://") :]
    if addr_host in ("*", "0.0.0.0", "::", "[::]"):
        # The engine binds every interface: reach it at the pod's own host.
        return f"tcp://{host}:{int(port) + rank}", False
    return f"tcp://{addr_host}:{int(port) + rank}", bind


@dataclass
class RankState:
    """What the router knows about one DP rank's load. `inflight` is the router's own count (the freshest signal);
    the rest comes from the engine's /metrics, at most one poll interval old."""

    inflight: int = 0
    inflight_tokens: int = 0
    # KV the requests in flight may occupy (shared prompt blocks once, plus outputs): KV admission.
    kv: InflightKV = field(default_factory=InflightKV)
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    # KV capacity in blocks, from vllm:cache_config_info: sizes the approximate scorer's memory of each pod.
    kv_capacity_blocks: int = 0
    cpu_capacity_blocks: int = 0
    engine_id: str | None = None  # learned from a prefill response's kv_transfer_params
    side_channel: tuple[str, int] | None = None  # likewise


@dataclass
class Pod:
    info: PodInfo
    healthy: bool = False
    ranks: list[RankState] = field(default_factory=list)
    failures: int = 0
    last_change: float = 0.0
    replay_endpoints: dict[int, str] = field(default_factory=dict)  # learned from /kv_event_sources

    def __post_init__(self) -> None:
        if not self.ranks:
            self.ranks = [RankState() for _ in range(self.info.dp_size)]

    @property
    def name(self) -> str:
        return self.info.name

    def engine_id_of(self, rank: int) -> str | None:
        return self.info.engine_id_of(rank) or self.ranks[rank].engine_id

    def side_channel_of(self, rank: int) -> tuple[str, int] | None:
        return self.info.side_channel_of(rank) or self.ranks[rank].side_channel

    def replay_address(self, rank: int) -> str | None:
        return self.info.replay_address(rank) or self.replay_endpoints.get(rank)


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


_FIELDS = {
    "name": str,
    "role": str,
    "url": str,
    "dp_size": int,
    "kv_events_endpoint": (str, type(None)),
    "kv_events_replay_endpoint": (str, type(None)),
    "kv_events_bind": bool,
    "side_channel_host": (str, type(None)),
    "side_channel_port": (int, type(None)),
    "engine_id": (str, type(None)),
}
_REQUIRED = ("name", "url")


def parse_discovery(data: Any, source: str = "discovery file") -> list[PodInfo]:
    """Validate a discovery document; UserError names the entry and field at fault."""
    if not isinstance(data, list):
        raise UserError(f"{source}: expected a JSON list of engine entries, got {type(data).__name__}")
    pods: list[PodInfo] = []
    names: set[str] = set()
    for i, entry in enumerate(data):
        where = f"{source}: entry {i}"
        if not isinstance(entry, dict):
            raise UserError(f"{where}: expected an object like {{'name': ..., 'url': ...}}")
        for key in _REQUIRED:
            if key not in entry:
                raise UserError(f"{where}: missing {key!r}")
        kw: dict[str, Any] = {}
        for key, value in entry.items():
            want = _FIELDS.get(key)
            if want is None:
                continue  # launchers may add fields for other readers
            is_bool_for_number = isinstance(value, bool) and want is not bool
            if is_bool_for_number or not isinstance(value, want):
                raise UserError(f"{where}: {key!r} has the wrong type ({type(value).__name__})")
            kw[key] = value
        kw.setdefault("role", "both")
        if kw["role"] not in ROLES:
            raise UserError(f"{where}: role {kw['role']!r} is not one of {', '.join(ROLES)}")
        if kw.get("dp_size", 1) < 1:
            raise UserError(f"{where}: dp_size must be >= 1")
        url = urlsplit(kw["url"])
        if url.scheme not in ("http", "https") or not url.hostname:
            raise UserError(f"{where}: url {kw['url']!r} is not an http(s) URL like http://10.0.0.5:8200")
        kw["url"] = kw["url"].rstrip("/")
        if kw["name"] in names:
            raise UserError(f"{where}: name {kw['name']!r} appears twice")
        names.add(kw["name"])
        pods.append(PodInfo(**kw))
    return pods


def load_discovery(path: str | os.PathLike[str]) -> list[PodInfo]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise UserError(f"cannot read the discovery file {path}: {exc.strerror or exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"discovery file {path} is not valid JSON: {exc}") from exc
    return parse_discovery(data, str(path))


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
    ) -> None:
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
        for r in pod.ranks:
            r.running = r.waiting = 0
            r.kv_usage = 0.0
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
            mtime = self.discovery.stat().st_mtime_ns
        except OSError:
            return False  # not written yet (or being replaced): keep what we have
        if mtime == self._mtime:
            return False
        try:
            infos = load_discovery(self.discovery)
        except UserError as exc:
            # A half-written file: keep the current set, try again on the next change (or the next poll).
            self.discovery_errors += 1
            log.warning("%s", exc)
            return False
        self._mtime = mtime
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
                await r.read()
                if r.status != 200:
                    reason = f"/health answered {r.status}"
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
                    got = _rank_address(src["replay_endpoint"], 0, pod.info.host, False)
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
    """(DP rank, RankState field, value) for the vLLM gauges the router reads; a line scan, no full parser.

    vllm:cache_config_info is an info gauge: its value is 1 and the KV capacity sits in its labels."""
    out = []
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        series, _, value = line.rpartition(" ")
        name, _, labels = series.partition("{")
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
            continue
        attr = _GAUGES.get(name)
        if attr is None:
            continue
        try:
            out.append((rank, attr, float(value)))
        except ValueError:
            continue
    return out
