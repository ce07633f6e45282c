"""The lines every benchmark prints: `name: value  # target >= T (ratio R)` for a figure with a target, `# name: value`
for context. One format, so `make bench`'s output reads (and greps) the same for every benchmark."""

from __future__ import annotations

import socket


def report(name: str, value: float, target: float, higher_is_better: bool, fmt: str = "{:.2f}") -> None:
    ratio = value / target if higher_is_better else target / max(value, 1e-12)
    op = ">=" if higher_is_better else "<="
    print(f"{name}: {fmt.format(value)}  # target {op} {target:g} (ratio {ratio:.2f})", flush=True)


def info(name: str, value: object) -> None:
    print(f"# {name}: {value}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
