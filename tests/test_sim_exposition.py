"""The simulated engine's /metrics text: byte for byte prometheus_client's generate_latest, whatever the values."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

from llmd.engines.sim.exposition import TextRenderer
from llmd.engines.sim.metrics import EngineMetrics


def _registry() -> tuple[CollectorRegistry, list]:
    r = CollectorRegistry()
    c = Counter("vllm:requests", "Requests.\nSecond line with a \\ backslash.", ["model_name", "engine"], registry=r)
    g = Gauge("vllm:kv_cache_usage_perc", "KV use.", ["engine"], registry=r)
    h = Histogram("vllm:ttft_seconds", "TTFT.", ["model_name"], buckets=[0.1, 1.0, 10.0], registry=r)
    i = Info("vllm:cache_config", "Cache config.", registry=r)
    i.info({"block_size": "16", "num_gpu_blocks": "100"})
    return r, [c, g, h]


def test_text_is_generate_latests_through_updates() -> None:
    r, (c, g, h) = _registry()
    text = TextRenderer()
    rng = random.Random(0)
    values = [0.0, -0.0, 1e-12, 3.5, 1e21, float("inf"), float("-inf"), float("nan"), 12345678901234.0]
    for step in range(40):
        c.labels('tiny "quoted"\\model\n', str(step % 3)).inc(rng.random() * 10)
        g.labels(str(step % 4)).set(rng.choice(values))
        h.labels("tiny").observe(rng.choice((0.05, 0.5, 5.0, 50.0)))
        assert text.render(r) == generate_latest(r), step


def test_the_engines_own_families_are_written_as_generate_latest_writes_them() -> None:
    m = EngineMetrics("tiny", [0, 1], 32768, cache_config={"num_gpu_blocks": "100", "block_size": "16"})

    # The process and GC collectors' figures change between two calls: compared without their lines.
    def strip(b: bytes) -> list[str]:
        return [line for line in b.decode().splitlines() if not line.startswith(("process_", "python_gc_"))]

    m.rank(1).running.set(3)
    assert strip(m.render()) == strip(generate_latest(m.registry))
    assert "vllm:num_requests_running{" in m.render().decode()


def test_a_name_it_would_write_otherwise_is_refused() -> None:
    r = CollectorRegistry()
    Gauge("ok_name", "x", ["a"], registry=r).labels("v").set(1)
    assert TextRenderer().render(r) == generate_latest(r)
    Gauge("odd", "x", ["bad:label"], registry=r).labels("v").set(1)
    with pytest.raises(ValueError, match="not a legacy Prometheus name"):
        TextRenderer().render(r)
