"""Prometheus metrics of a simulated engine under vLLM 0.32's names, labels and buckets.

Names and buckets: vllm/v1/metrics/loggers.py (PrometheusStatLogger), vllm/v1/metrics/buckets.py, vllm/v1/metrics/
perf.py (the MFU counters), and for P/D the NIXL connector's vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py
(exported only when a KV connector is configured, as vLLM). Every engine series carries `model_name` (the served name)
and `engine` (the DP rank as a string), as vLLM labels them. Beside them, as on vLLM's /metrics: prometheus_client's
process, platform and GC collectors, and prometheus-fastapi-instrumentator's HTTP metrics (`HttpMetrics`). One
registry per server, so several engines in one process keep separate series. Times are in simulated seconds (wall
seconds at time_scale 1), HTTP durations in wall seconds.
"""

from __future__ import annotations

import re
import time
from bisect import bisect_left
from collections.abc import Iterator, Mapping, Sequence

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from llmd.engines.sim.exposition import TextRenderer

__all__ = ["CONTENT_TYPE", "EngineMetrics", "HttpMetrics", "RankMetrics"]

REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
NIXL_XFER_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
NIXL_BYTES_BUCKETS = tuple(2 ** (10 + i) for i in range(1, 25, 2))
NIXL_DESCRIPTORS_BUCKETS = (10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
WAITING_REASONS = ("capacity", "deferred")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")
KV_FETCH_STAGES = ("waiting_to_start", "in_progress", "completed_waiting")
# prometheus-fastapi-instrumentator's defaults, as vLLM attaches it (vllm/entrypoints/serve/instrumentator/metrics.py).
HTTP_HIGHR_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5, 7.5, 10, 30,
                      60)  # fmt: skip
HTTP_LOWR_BUCKETS = (0.1, 0.5, 1)
HTTP_EXCLUDED_HANDLERS = tuple(
    re.compile(p) for p in ("/metrics", "/health", "/load", "/ping", "/version", "/server_info")
)
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")


def request_token_buckets(max_model_len: int) -> list[float]:
    """vLLM's 1-2-5 series up to max_model_len (buckets.build_1_2_5_buckets)."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_model_len:
                return out
            out.append(value)
        exponent += 1


class EngineMetrics:
    """The metric families of one server; `rank(r)` gives the children for DP rank r.

    `kv_connector`: a KV connector (NixlConnector, kv_both) is configured: the NIXL families and the KV-fetch gauge
    exist. `cache_config`: vLLM's CacheConfig.metrics_info() (label -> value) for vllm:cache_config_info.
    """

    def __init__(
        self,
        model_name: str,
        dp_ranks: Sequence[int],
        max_model_len: int,
        *,
        kv_connector: bool = True,
        cache_config: Mapping[str, str] | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.kv_connector = kv_connector
        r = self.registry
        for collector in (GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR):
            r.register(collector)
        labels = ["model_name", "engine"]
        tok_buckets = request_token_buckets(max_model_len)
        # Families of an absent KV connector are made but not registered: they count, nobody sees them.
        conn = r if kv_connector else None

        def gauge(name: str, doc: str, extra: Sequence[str] = ()) -> Gauge:
            return Gauge(name, doc, [*labels, *extra], registry=r)

        def counter(name: str, doc: str, extra: Sequence[str] = (), registry: CollectorRegistry | None = r) -> Counter:
            return Counter(name, doc, [*labels, *extra], registry=registry)

        def hist(name: str, doc: str, buckets: Sequence[float], registry: CollectorRegistry | None = r) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=registry)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.waiting_by_reason = gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; "
            "'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all "
            "reasons equals vllm:num_requests_waiting.",
            ["reason"],
        )
        self.kv_fetch_by_stage = Gauge(
            "vllm:num_requests_kv_fetch_by_stage",
            "Number of waiting requests by async KV load stage. Stage labels: 'waiting_to_start' = needs an async KV "
            "load that has not started; 'in_progress' = load started and not yet reported finished; "
            "'completed_waiting' = load finished, request not running yet.",
            [*labels, "stage"],
            registry=conn,
        )
        self.sleep_state = gauge(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
            "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            ["sleep_state"],
        )
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.ext_prefix_queries = counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of "
            "queried tokens.",
        )
        self.ext_prefix_hits = counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached "
            "tokens.",
        )
        self.mm_cache_queries = counter(
            "vllm:mm_cache_queries", "Multi-modal cache queries, in terms of number of queried items."
        )
        self.mm_cache_hits = counter(
            "vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items."
        )
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.admission_rejections = Counter(
            "vllm:admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason.",
            ["model_name", "reason"],
            registry=r,
        )
        for reason in ADMISSION_REASONS:
            self.admission_rejections.labels(model_name, reason)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_by_source = counter(
            "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", ["source"]
        )
        self.prompt_cached = counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).")
        self.prompt_cached_by_source = counter(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host (offloaded to "
            "DRAM), disk, p2p (transferred from another vLLM instance) or external_unspecified. Counted at admission; "
            "sums to vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.",
            ["source"],
        )
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.request_success = counter(
            "vllm:request_success", "Count of successfully processed requests.", ["finished_reason"]
        )
        self.req_prompt_tokens = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tok_buckets)
        self.req_gen_tokens = hist(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tok_buckets
        )
        self.iteration_tokens = hist(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS
        )
        self.req_max_gen_tokens = hist(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            tok_buckets,
        )
        self.req_params_n = hist(
            "vllm:request_params_n", "Histogram of the n request parameter.", REQUEST_PARAMS_N_BUCKETS
        )
        self.req_params_max_tokens = hist(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", tok_buckets
        )
        self.ttft = hist(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.tpot = hist(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS
        )
        self.queue_time = hist(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference_time = hist(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill_time = hist(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode_time = hist(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.req_preemptions = hist(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            NUM_PREEMPTIONS_BUCKETS,
        )
        self.req_prefill_computed = hist(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            tok_buckets,
        )
        # NIXL connector (P/D transfers), as the decode side records them.
        self.nixl_xfer_time = hist(
            "vllm:nixl_xfer_time_seconds",
            "Histogram of transfer duration for NIXL KV Cache transfers.",
            NIXL_XFER_TIME_BUCKETS,
            registry=conn,
        )
        self.nixl_post_time = hist(
            "vllm:nixl_post_time_seconds",
            "Histogram of transfer post time for NIXL KV Cache transfers.",
            (0.001, *NIXL_XFER_TIME_BUCKETS),
            registry=conn,
        )
        self.nixl_bytes = hist(
            "vllm:nixl_bytes_transferred",
            "Histogram of bytes transferred per NIXL KV Cache transfers.",
            NIXL_BYTES_BUCKETS,
            registry=conn,
        )
        self.nixl_descriptors = hist(
            "vllm:nixl_num_descriptors",
            "Histogram of number of descriptors per NIXL  KV Cache transfers.",
            NIXL_DESCRIPTORS_BUCKETS,
            registry=conn,
        )
        self.nixl_failed = counter(
            "vllm:nixl_num_failed_transfers",
            "Number of failed NIXL KV Cache transfers, including handshake and notification failures. NOTE: KV expiry "
            "is tracked separately in vllm:nixl_num_kv_expired_reqs.",
            registry=conn,
        )
        self.nixl_expired = counter(
            "vllm:nixl_num_kv_expired_reqs",
            "Number of requests that had their KV expire. NOTE: This metric is tracked on the P instance.",
            registry=conn,
        )
        # MFU counters (vllm/v1/metrics/perf.py): they only move under --enable-mfu-metrics, as in vLLM.
        self.flops = counter(
            "vllm:estimated_flops_per_gpu",
            "Estimated number of floating point operations per GPU (for Model Flops Utilization calculations).",
        )
        self.read_bytes = counter(
            "vllm:estimated_read_bytes_per_gpu",
            "Estimated number of bytes read from memory per GPU (for Model Flops Utilization calculations).",
        )
        self.write_bytes = counter(
            "vllm:estimated_write_bytes_per_gpu",
            "Estimated number of bytes written to memory per GPU (for Model Flops Utilization calculations).",
        )
        if cache_config is not None:
            # vLLM's log_metrics_info: an info gauge of 1 per engine whose labels are CacheConfig's fields.
            info = dict(cache_config)
            info["engine"] = ""
            names = sorted(info)
            gauge_info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", names, registry=r)
            for rank in dp_ranks:
                info["engine"] = str(rank)
                gauge_info.labels(**info).set(1)
        self.http = HttpMetrics(r)
        self._ranks = {rank: RankMetrics(self, rank) for rank in dp_ranks}
        self._text = TextRenderer()  # generate_latest's bytes, its line heads remembered

    def rank(self, dp_rank: int) -> RankMetrics:
        return self._ranks[dp_rank]

    def render(self) -> bytes:
        return self._text.render(self.registry)


class RankMetrics:
    """The children of every family for one DP rank, created up front so every series exists from the start (vLLM
    creates its per-engine children at start-up, which is what scrapers see before the first request)."""

    def __init__(self, m: EngineMetrics, dp_rank: int) -> None:
        lv = (m.model_name, str(dp_rank))
        self.running = m.running.labels(*lv)
        self.waiting = m.waiting.labels(*lv)
        self.waiting_by_reason = {w: m.waiting_by_reason.labels(*lv, w) for w in WAITING_REASONS}
        self.kv_fetch_by_stage = {st: m.kv_fetch_by_stage.labels(*lv, st) for st in KV_FETCH_STAGES}
        for st in SLEEP_STATES:
            m.sleep_state.labels(*lv, st).set(1 if st == "awake" else 0)
        self.mm_cache_queries = m.mm_cache_queries.labels(*lv)
        self.mm_cache_hits = m.mm_cache_hits.labels(*lv)
        self.flops = m.flops.labels(*lv)
        self.read_bytes = m.read_bytes.labels(*lv)
        self.write_bytes = m.write_bytes.labels(*lv)
        self.kv_usage = m.kv_usage.labels(*lv)
        self.prefix_queries = m.prefix_queries.labels(*lv)
        self.prefix_hits = m.prefix_hits.labels(*lv)
        self.ext_prefix_queries = m.ext_prefix_queries.labels(*lv)
        self.ext_prefix_hits = m.ext_prefix_hits.labels(*lv)
        self.preemptions = m.preemptions.labels(*lv)
        self.prompt_tokens = m.prompt_tokens.labels(*lv)
        self.prompt_by_source = {s: m.prompt_by_source.labels(*lv, s) for s in PROMPT_SOURCES}
        self.prompt_cached = m.prompt_cached.labels(*lv)
        self.prompt_cached_by_source = {s: m.prompt_cached_by_source.labels(*lv, s) for s in CACHE_HIT_SOURCES}
        self.generation_tokens = m.generation_tokens.labels(*lv)
        self.request_success = {r: m.request_success.labels(*lv, r) for r in FINISH_REASONS}
        self.req_prompt_tokens = m.req_prompt_tokens.labels(*lv)
        self.req_gen_tokens = m.req_gen_tokens.labels(*lv)
        self.iteration_tokens = m.iteration_tokens.labels(*lv)
        self.req_max_gen_tokens = m.req_max_gen_tokens.labels(*lv)
        self.req_params_n = m.req_params_n.labels(*lv)
        self.req_params_max_tokens = m.req_params_max_tokens.labels(*lv)
        self.ttft = m.ttft.labels(*lv)
        self.itl = m.itl.labels(*lv)
        self.tpot = m.tpot.labels(*lv)
        self.e2e = m.e2e.labels(*lv)
        self.queue_time = m.queue_time.labels(*lv)
        self.inference_time = m.inference_time.labels(*lv)
        self.prefill_time = m.prefill_time.labels(*lv)
        self.decode_time = m.decode_time.labels(*lv)
        self.req_preemptions = m.req_preemptions.labels(*lv)
        self.req_prefill_computed = m.req_prefill_computed.labels(*lv)
        self.nixl_xfer_time = m.nixl_xfer_time.labels(*lv)
        self.nixl_post_time = m.nixl_post_time.labels(*lv)
        self.nixl_bytes = m.nixl_bytes.labels(*lv)
        self.nixl_descriptors = m.nixl_descriptors.labels(*lv)
        self.nixl_failed = m.nixl_failed.labels(*lv)
        self.nixl_expired = m.nixl_expired.labels(*lv)
        self._fetching = False

    def scheduler_state(self, running: int, waiting: int, kv_usage: float, pulling: int = 0, kv_ready: int = 0) -> None:
        """Scheduler gauges. `pulling`: waiting requests whose KV is being pulled, `kv_ready`: pulled, not yet
        running; both are vLLM's skipped ("deferred") waiting requests, the rest wait for capacity."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.waiting_by_reason["deferred"].set(pulling)
        self.waiting_by_reason["capacity"].set(max(waiting - pulling, 0))
        if pulling or kv_ready or self._fetching:
            self.kv_fetch_by_stage["in_progress"].set(pulling)
            self.kv_fetch_by_stage["completed_waiting"].set(kv_ready)
            self._fetching = bool(pulling or kv_ready)
        self.kv_usage.set(kv_usage)

    def step_work(self, flops: float, read_bytes: float, write_bytes: float) -> None:
        """One engine step's estimated work per GPU (--enable-mfu-metrics)."""
        if flops or read_bytes or write_bytes:
            self.flops.inc(flops)
            self.read_bytes.inc(read_bytes)
            self.write_bytes.inc(write_bytes)

    def prompt_admitted(self, prompt_len: int, local_hit: int, external_hit: int) -> None:
        """A request got its first token: its prompt by source (vLLM counts these when prefill completes)."""
        computed = max(prompt_len - local_hit - external_hit, 0)
        self.prompt_tokens.inc(prompt_len)
        self.prompt_by_source["local_compute"].inc(computed)
        self.prompt_by_source["local_cache_hit"].inc(local_hit)
        self.prompt_by_source["external_kv_transfer"].inc(external_hit)
        self.prompt_cached.inc(local_hit + external_hit)
        self.prompt_cached_by_source["device"].inc(local_hit)
        self.prompt_cached_by_source["p2p"].inc(external_hit)

    def transfer(self, seconds: float, nbytes: int, descriptors: int, ok: bool) -> None:
        if ok:
            self.nixl_xfer_time.observe(seconds)
            self.nixl_post_time.observe(0.0)
            self.nixl_bytes.observe(nbytes)
            self.nixl_descriptors.observe(descriptors)
        else:
            self.nixl_failed.inc()


class HttpMetrics:
    """prometheus-fastapi-instrumentator's default metrics, as vLLM's API server exports them: every request but the
    excluded handlers, by method, grouped status ("2xx") and route template ("none" for an unknown route).

    A collector of plain tallies (the request path only adds numbers), rendered as the instrumentator's Counter,
    Summaries and Histograms render, `_created` samples included."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._totals: dict[tuple[str, str, str], list[float]] = {}  # (method, status, handler) -> [count, created]
        self._sizes: dict[str, list[float]] = {}  # handler -> [n, request bytes, response bytes, created]
        self._lowr: dict[tuple[str, str], list[float]] = {}  # (method, handler) -> [*bucket counts, sum, created]
        self._highr = [0.0] * (len(HTTP_HIGHR_BUCKETS) + 1) + [0.0]  # bucket counts (+Inf last), sum
        self._highr_created = time.time()
        registry.register(self)

    @staticmethod
    def excluded(path_or_template: str) -> bool:
        return any(p.search(path_or_template) for p in HTTP_EXCLUDED_HANDLERS)

    def observe(self, method: str, status: int, handler: str, in_size: int, out_size: int, seconds: float) -> None:
        key = (method, f"{str(status)[0]}xx", handler)
        total = self._totals.get(key)
        if total is None:
            total = self._totals[key] = [0, time.time()]
        total[0] += 1
        sizes = self._sizes.get(handler)
        if sizes is None:
            sizes = self._sizes[handler] = [0, 0, 0, time.time()]
        sizes[0] += 1
        sizes[1] += in_size
        sizes[2] += out_size
        highr = self._highr
        highr[bisect_left(HTTP_HIGHR_BUCKETS, seconds)] += 1
        highr[-1] += seconds
        lkey = (method, handler)
        lowr = self._lowr.get(lkey)
        if lowr is None:
            lowr = self._lowr[lkey] = [0.0] * (len(HTTP_LOWR_BUCKETS) + 2) + [time.time()]
        lowr[bisect_left(HTTP_LOWR_BUCKETS, seconds)] += 1
        lowr[-2] += seconds

    def collect(self) -> Iterator[Metric]:
        total = CounterMetricFamily(
            "http_requests_total",
            "Total number of requests by method, status and handler.",
            labels=("method", "status", "handler"),
        )
        for key, (count, created) in self._totals.items():
            total.add_metric(key, count, created=created)
        yield total
        for i, name, doc in (
            (1, "http_request_size_bytes", "Content length of incoming requests by handler."),
            (2, "http_response_size_bytes", "Content length of outgoing responses by handler."),
        ):
            fam = SummaryMetricFamily(
                name,
                f"{doc} Only value of header is respected. Otherwise ignored. No percentile calculated. ",
                labels=("handler",),
            )
            for handler, sizes in self._sizes.items():
                fam.add_metric((handler,), sizes[0], sizes[i])
                fam.samples.append(Sample(f"{name}_created", {"handler": handler}, sizes[3]))
            yield fam
        highr = HistogramMetricFamily(
            "http_request_duration_highr_seconds",
            "Latency with many buckets but no API specific labels. Made for more accurate percentile calculations. ",
        )
        highr.add_metric((), _cumulative(HTTP_HIGHR_BUCKETS, self._highr), self._highr[-1])
        highr.samples.append(Sample("http_request_duration_highr_seconds_created", {}, self._highr_created))
        yield highr
        lowr = HistogramMetricFamily(
            "http_request_duration_seconds",
            "Latency with only few buckets by handler. Made to be only used if aggregation by handler is important. ",
            labels=("method", "handler"),
        )
        for (method, handler), tally in self._lowr.items():
            lowr.add_metric((method, handler), _cumulative(HTTP_LOWR_BUCKETS, tally), tally[-2])
            lowr.samples.append(
                Sample("http_request_duration_seconds_created", {"method": method, "handler": handler}, tally[-1])
            )
        yield lowr


def _cumulative(bounds: Sequence[float], counts: list[float]) -> list[tuple[str, float]]:
    """Per-bucket counts (+Inf last) as a histogram family's cumulative ("le", count) pairs."""
    out = []
    acc = 0.0
    for bound, n in zip((*bounds, float("inf")), counts, strict=False):
        acc += n
        out.append((floatToGoString(bound), acc))
    return out
