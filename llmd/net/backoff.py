"""Exponential backoff with full jitter for a client whose server stopped answering: one state shared by every sender
of a run, so a fleet of agents slows down together instead of each hammering a dead address."""

from __future__ import annotations

import random


class Backoff:
    """After the k-th failure in a row every sender waits until a time drawn uniformly from [0, min(cap, base * 2^k))
    from now (AWS's "full jitter": spreads the retries of many senders); a success resets the streak. Pure: the
    caller passes the clock."""

    def __init__(self, base_s: float = 0.1, cap_s: float = 10.0, rng: random.Random | None = None) -> None:
        self.base_s = base_s
        self.cap_s = cap_s
        self.rng = rng or random.Random()
        self.failures = 0  # in a row
        self.until = 0.0  # no send before this time

    def failed(self, now: float) -> float:
        """One more failure; returns the delay drawn."""
        ceiling = min(self.cap_s, self.base_s * 2.0 ** min(self.failures, 60))
        self.failures += 1
        delay = self.rng.uniform(0.0, ceiling)
        self.until = max(self.until, now + delay)
        return delay

    def succeeded(self) -> None:
        self.failures = 0

    def wait_s(self, now: float) -> float:
        return max(0.0, self.until - now)
