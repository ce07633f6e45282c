"""Prometheus metrics of a simulated engine under vLLM 0.32's names, labels and buckets.

Names and buckets: vllm/v1/metrics/loggers.py (PrometheusStatLogger), vllm/v1/metrics/buckets.py, and for P/D the
NIXL connector's vllm/distributed/kv_transfer/kv_connector/v1/nixl/stats.py. Every series carries
`model_name` (the served name) and `engine` (the DP rank as a string), as vLLM labels them. One registry per server,
so several engines in one process keep separate series. Times are in simulated seconds (wall seconds at time_scale 1).
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["CONTENT_TYPE", "EngineMetrics", "RankMetrics"]

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
    """The metric families of one server; `rank(r)` gives the children for DP rank r."""

    def __init__(self, model_name: str, dp_ranks: Sequence[int], max_model_len: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        r = self.registry
        labels = ["model_name", "engine"]
        tok_buckets = request_token_buckets(max_model_len)

        def gauge(name: str, doc: str, extra: Sequence[str] = ()) -> Gauge:
            return Gauge(name, doc, [*labels, *extra], registry=r)

        def counter(name: str, doc: str, extra: Sequence[str] = ()) -> Counter:
            return Counter(name, doc, [*labels, *extra], registry=r)

        def hist(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
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
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
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
        )
        self.nixl_post_time = hist(
            "vllm:nixl_post_time_seconds",
            "Histogram of transfer post time for NIXL KV Cache transfers.",
            (0.001, *NIXL_XFER_TIME_BUCKETS),
        )
        self.nixl_bytes = hist(
            "vllm:nixl_bytes_transferred",
            "Histogram of bytes transferred per NIXL KV Cache transfers.",
            NIXL_BYTES_BUCKETS,
        )
        self.nixl_descriptors = hist(
            "vllm:nixl_num_descriptors",
            "Histogram of number of descriptors per NIXL  KV Cache transfers.",
            NIXL_DESCRIPTORS_BUCKETS,
        )
        self.nixl_failed = counter(
            "vllm:nixl_num_failed_transfers",
            "Number of failed NIXL KV Cache transfers, including handshake and notification failures. NOTE: KV expiry "
            "is tracked separately in vllm:nixl_num_kv_expired_reqs.",
        )
        self.nixl_expired = counter(
            "vllm:nixl_num_kv_expired_reqs",
            "Number of requests that had their KV expire. NOTE: This metric is tracked on the P instance.",
        )
        self._ranks = {rank: RankMetrics(self, rank) for rank in dp_ranks}

    def rank(self, dp_rank: int) -> RankMetrics:
        return self._ranks[dp_rank]

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RankMetrics:
    """The children of every family for one DP rank, created up front so every series exists from the start (vLLM
    creates its per-engine children at start-up, which is what scrapers see before the first request)."""

    def __init__(self, m: EngineMetrics, dp_rank: int) -> None:
        lv = (m.model_name, str(dp_rank))
        self.running = m.running.labels(*lv)
        self.waiting = m.waiting.labels(*lv)
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

    def scheduler_state(self, running: int, waiting: int, kv_usage: float) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)

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
