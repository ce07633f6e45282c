"""The Prometheus text format of a registry, byte for byte what prometheus_client's generate_latest writes: the
lines' names and label sets are formatted once and remembered, only the values each time.

Why it matters: the router scrapes every engine's /metrics each second for its gauges, and a simulated engine's
families (vLLM's, with their histograms: ~860 samples, 57 KB) took generate_latest ~9-11 ms to write, on the core the
engines share with their load (benchmarks/router.py's fleet: ~5% of it at 4 engines). Written here: ~5.5 ms, most of
it prometheus_client's own collect(). vLLM's /metrics writes the same text.
"""

from __future__ import annotations

from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

_OM_SUFFIXES = ("_created", "_gsum", "_gcount")  # OpenMetrics samples generate_latest moves to gauges at the end
_MAX_CACHED = 100_000  # remembered line heads; a registry whose label sets keep changing starts over past it


def _escape_value(v: str) -> str:
    return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _escape_doc(d: str) -> str:
    return d.replace("\\", r"\\").replace("\n", r"\n")


class TextRenderer:
    """generate_latest for registries whose metric and label names are legacy Prometheus names (vLLM's are: `:` and
    `_` only); it raises ValueError for any other, rather than write them differently."""

    def __init__(self) -> None:
        self._heads: dict[tuple[str, tuple[tuple[str, str], ...]], str] = {}
        self._families: dict[tuple[str, str, str], tuple[str, str]] = {}

    def render(self, registry: Collector) -> bytes:
        out: list[str] = []
        heads = self._heads
        for metric in registry.collect():
            name, mtype = metric.name, metric.type
            fam = self._families.get((name, mtype, metric.documentation))
            if fam is None:
                fam = self._family(name, mtype, metric.documentation)
            out.append(fam[0])
            om: dict[str, list[str]] = {}
            for s in metric.samples:
                key = (s.name, tuple(s.labels.items()))
                head = heads.get(key)
                if head is None:
                    head = self._head(s.name, s.labels)
                    if len(heads) >= _MAX_CACHED:
                        heads.clear()
                    heads[key] = head
                line = head + floatToGoString(s.value)
                if s.timestamp is not None:
                    line += f" {int(float(s.timestamp) * 1000):d}"  # in milliseconds
                line += "\n"
                for suffix in _OM_SUFFIXES:
                    if s.name == name + suffix:
                        om.setdefault(suffix, []).append(line)
                        break
                else:
                    out.append(line)
            for suffix, lines in sorted(om.items()):
                out.append(f"# HELP {name}{suffix} {fam[1]}\n# TYPE {name}{suffix} gauge\n")
                out.extend(lines)
        return "".join(out).encode("utf-8")

    def _family(self, name: str, mtype: str, doc: str) -> tuple[str, str]:
        shown, kind = name, mtype
        if mtype == "counter":
            shown = name + "_total"
        elif mtype == "info":
            shown, kind = name + "_info", "gauge"
        elif mtype == "stateset":
            kind = "gauge"
        elif mtype == "gaugehistogram":
            kind = "histogram"
        elif mtype == "unknown":
            kind = "untyped"
        _check_name(shown)
        help_text = _escape_doc(doc)
        got = (f"# HELP {shown} {help_text}\n# TYPE {shown} {kind}\n", help_text)
        self._families[(name, mtype, doc)] = got
        return got

    @staticmethod
    def _head(name: str, labels: dict[str, str]) -> str:
        _check_name(name)
        if not labels:
            return name + " "
        for k in labels:
            _check_name(k, label=True)
        inner = ",".join(f'{k}="{_escape_value(v)}"' for k, v in sorted(labels.items()))
        return f"{name}{{{inner}}} "


def _check_name(name: str, label: bool = False) -> None:
    # generate_latest writes other names escaped or quoted; none of the engine's families have one.
    extra = "_" if label else "_:"
    ok = name.isascii() and bool(name) and (name[0].isalpha() or name[0] in extra)
    if not ok or not all(c.isalnum() or c in extra for c in name):
        what = "label" if label else "metric"
        raise ValueError(f"{what} name {name!r} is not a legacy Prometheus name")
