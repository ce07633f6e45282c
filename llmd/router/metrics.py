"""The router's Prometheus metrics: requests and errors by route, routing decisions, hops, queueing, and per-pod load.

Counters touched on the request path are pre-bound where their labels are known up front; per-pod gauges and the KV
event counters are read from live state when /metrics is scraped (a collector), so the hot path pays nothing for them.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

CONTENT_TYPE = CONTENT_TYPE_LATEST
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0)  # fmt: skip
TOKEN_BUCKETS = (0, 64, 256, 1024, 4096, 16384, 65536, 131072, 262144, 524288, 1048576)
# The route label's values: the router's own routes, every other path is "other". Labelling by the raw path would let
# any client create a series per path it makes up (`route="/etc/passwd"`), without bound.
ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"})
OTHER_ROUTE = "other"
# A request whose client went away before it was answered; nginx's code for it (never sent to anyone).
CLIENT_CLOSED = 499


def route_label(path: str) -> str:
    return path if path in ROUTES else OTHER_ROUTE


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter("llmd_router_requests", "Requests answered, by route (the router's routes, else "
                                "'other') and HTTP status (499: the client left before the answer).",
                                ["route", "status"], registry=r)  # fmt: skip
        self.errors = Counter(
            "llmd_router_errors", "Failed requests, by route and kind.", ["route", "kind"], registry=r
        )
        self.decisions = Counter(
            "llmd_router_routing_decisions",
            "Routing decisions, by policy and reason.",
            ["policy", "reason"],
            registry=r,
        )
        self.expected_hit_tokens = Counter(
            "llmd_router_expected_hit_tokens", "Prompt tokens the router expected to be cached at the chosen pod.",
            registry=r,
        )  # fmt: skip
        self.expected_hit_hist = Hist(
            "llmd_router_request_expected_hit_tokens", "Expected cached prompt tokens per request.", TOKEN_BUCKETS
        )
        self.prompt_tokens = Counter("llmd_router_prompt_tokens", "Prompt tokens routed (router tokenization).",
                                     registry=r)  # fmt: skip
        self.pd = Counter("llmd_router_pd", "Disaggregated requests: outcome ok or fallback (decode-only).",
                          ["outcome"], registry=r)  # fmt: skip
        self.p2p = Counter("llmd_router_p2p", "Requests told to pull a cached prefix from a peer, by outcome.",
                           ["outcome"], registry=r)  # fmt: skip
        self.retries = Counter("llmd_router_retries", "Requests sent again before any byte streamed, by reason "
                               "(resent: the same pod, its pooled connection closed under the request; others: "
                               "another pod).", ["reason"], registry=r)  # fmt: skip
        self.queue_time = Hist("llmd_router_queue_time_seconds", "Time waiting in the router's queue.",
                               SECONDS_BUCKETS)  # fmt: skip
        self.prefill_time = Hist("llmd_router_prefill_hop_seconds", "P/D: duration of the prefill hop.",
                                 SECONDS_BUCKETS)  # fmt: skip
        self.first_byte_time = Hist(
            "llmd_router_first_byte_seconds", "From admission to the first response byte of the serving pod.",
            SECONDS_BUCKETS,
        )  # fmt: skip
        self.routing_time = Hist(
            "llmd_router_routing_seconds", "Router work per request before the first hop (tokenize + schedule).",
            SECONDS_BUCKETS,
        )  # fmt: skip
        hists = (self.expected_hit_hist, self.queue_time, self.prefill_time, self.first_byte_time, self.routing_time)
        self.add_collector(lambda: (h.family() for h in hists))
        self._decision_children: dict[tuple[str, str], Any] = {}
        self._request_children: dict[tuple[str, int], Any] = {}
        self._error_children: dict[tuple[str, str], Any] = {}

    # Cached children: .labels() costs a few microseconds on every call.
    def request(self, route: str, status: int) -> None:
        route = route_label(route)
        key = (route, status)
        c = self._request_children.get(key)
        if c is None:
            c = self._request_children[key] = self.requests.labels(route, str(status))
        c.inc()

    def error(self, route: str, kind: str) -> None:
        route = route_label(route)
        key = (route, kind)
        c = self._error_children.get(key)
        if c is None:
            c = self._error_children[key] = self.errors.labels(route, kind)
        c.inc()

    def decision(self, policy: str, reason: str, expected_hit_tokens: int) -> None:
        key = (policy, reason)
        c = self._decision_children.get(key)
        if c is None:
            c = self._decision_children[key] = self.decisions.labels(policy, reason)
        c.inc()
        if expected_hit_tokens:
            self.expected_hit_tokens.inc(expected_hit_tokens)
        self.expected_hit_hist.observe(expected_hit_tokens)

    def add_collector(self, fn: Callable[[], Iterator[Any]]) -> None:
        self.registry.register(_FnCollector(fn))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class Hist:
    """A Prometheus histogram for the event loop's thread alone. prometheus_client's Histogram takes a lock and walks
    every bucket on each observation, and the request path makes four or five of them; this one bisects into plain
    ints and builds the family (the same _bucket/_sum/_count series) only when /metrics is scraped."""

    __slots__ = ("bounds", "counts", "doc", "name", "sum")

    def __init__(self, name: str, doc: str, buckets: Sequence[float]) -> None:
        self.name, self.doc = name, doc
        self.bounds = tuple(float(b) for b in buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # bucket `le` counts value <= le
        self.sum += value

    def family(self) -> HistogramMetricFamily:
        cumulative, total = [], 0
        for le, n in zip((*map(floatToGoString, self.bounds), "+Inf"), self.counts, strict=True):
            total += n
            cumulative.append((le, total))
        return HistogramMetricFamily(self.name, self.doc, buckets=cumulative, sum_value=self.sum)


class _FnCollector(Collector):
    def __init__(self, fn: Callable[[], Iterator[Any]]) -> None:
        self.fn = fn

    def collect(self) -> Iterator[Any]:
        yield from self.fn()

    def describe(self) -> list[Any]:
        return []  # dynamic families: no up-front description


def state_families(registry: Any, core: Any, hub: Any, index: Any) -> Iterator[Any]:
    """Per-pod gauges and event/index counters read at scrape time (registry: endpoints.EndpointRegistry; core:
    core.RouterCore, whose ledger and queue say what the router has in flight and waiting)."""
    healthy = GaugeMetricFamily("llmd_router_pod_healthy", "1 if the pod passes health checks.", labels=["pod", "role"])
    inflight = GaugeMetricFamily("llmd_router_pod_inflight", "Requests the router has in flight per pod rank.",
                                 labels=["pod", "rank"])  # fmt: skip
    running = GaugeMetricFamily("llmd_router_pod_running", "Engine-reported running requests per pod rank.",
                                labels=["pod", "rank"])  # fmt: skip
    waiting = GaugeMetricFamily("llmd_router_pod_queue", "Engine-reported waiting requests per pod rank.",
                                labels=["pod", "rank"])  # fmt: skip
    kv = GaugeMetricFamily("llmd_router_pod_kv_usage", "Engine-reported KV cache usage (0-1) per pod rank.",
                           labels=["pod", "rank"])  # fmt: skip
    for pod in registry.pods.values():
        healthy.add_metric([pod.name, pod.info.role], 1.0 if pod.healthy else 0.0)
        for r, st in enumerate(pod.ranks):
            labels = [pod.name, str(r)]
            inflight.add_metric(labels, core.ledger.inflight((pod.name, r)))
            running.add_metric(labels, st.running)
            waiting.add_metric(labels, st.waiting)
            kv.add_metric(labels, st.kv_usage)
    yield from (healthy, inflight, running, waiting, kv)
    q = GaugeMetricFamily("llmd_router_queue_depth", "Requests waiting in the router's queue.")
    q.add_metric([], core.queue.waiting)
    yield q
    s = GaugeMetricFamily("llmd_router_queue_sessions", "Sessions with requests waiting in the router's queue.")
    s.add_metric([], core.queue.sessions)
    yield s
    rej = CounterMetricFamily("llmd_router_queue_rejected", "Requests refused with 429 because the queue was full.")
    rej.add_metric([], core.queue.rejected)
    yield rej
    st = hub.stats
    for name, doc, value in (
        ("llmd_router_kv_event_batches", "KV event batches applied to the index.", st.batches),
        ("llmd_router_kv_event_gaps", "Sequence gaps accepted without a replay.", st.gaps),
        ("llmd_router_kv_event_duplicates", "Duplicate KV event batches skipped.", st.duplicates),
        ("llmd_router_kv_event_restarts", "KV event publishers seen restarting.", st.restarts),
        ("llmd_router_kv_event_replays_ok", "Replays completed.", st.replays_ok),
        ("llmd_router_kv_event_replays_failed", "Replays that timed out or failed.", st.replays_failed),
        ("llmd_router_kv_event_replayed_batches", "Batches received by replay.", st.replay_batches),
        (
            "llmd_router_kv_event_bad_frames",
            "KV event frames or events that did not decode, and batches the index "
            "could not apply (skipped; the subscription goes on).",
            st.bad_frames,
        ),
    ):
        c = CounterMetricFamily(name, doc)
        c.add_metric([], value)
        yield c
    e = GaugeMetricFamily("llmd_router_index_entries", "Block hashes in the router's KV index.")
    e.add_metric([], len(index))
    yield e
