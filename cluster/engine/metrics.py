"""Engine metrics: counters, gauges and latency histograms (vLLM's names, Prometheus buckets)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               40.0, 50.0, 60.0, 120.0)
# vLLM's request_latency_buckets, for the request-phase histograms (queue, prefill, decode,
# inference).
PHASE_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass(slots=True)
class Histogram:
    """Fixed buckets; `counts[i]` observations <= buckets[i] (not cumulative), +Inf last."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def copy(self) -> Histogram:
        return Histogram(self.buckets, list(self.counts), self.sum, self.count)


@dataclass(slots=True)
class RequestTimes:
    """Per-request timestamps the engine keeps to observe latencies."""

    arrival: float
    scheduled: float | None = None  # first planned into a step (the queue phase ends)
    first_token: float | None = None
    last_token: float | None = None


@dataclass(slots=True)
class LatencyMetrics:
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    # vLLM's request phases: queue (arrival -> scheduled), prefill (scheduled -> first token),
    # decode (first -> last token), inference (scheduled -> last token).
    queue: Histogram = field(default_factory=lambda: Histogram(PHASE_BUCKETS))
    prefill: Histogram = field(default_factory=lambda: Histogram(PHASE_BUCKETS))
    decode: Histogram = field(default_factory=lambda: Histogram(PHASE_BUCKETS))
    inference: Histogram = field(default_factory=lambda: Histogram(PHASE_BUCKETS))
    finished: dict[str, int] = field(
        default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})

    def on_tokens(self, t: RequestTimes, now: float, num_new_tokens: int) -> None:
        if num_new_tokens <= 0:
            return
        if t.first_token is None:
            t.first_token = now
            self.ttft.observe(now - t.arrival)
            num_new_tokens -= 1
        elif t.last_token is not None:
            # Several tokens in one delta share the gap, as vLLM counts them.
            gap = (now - t.last_token) / num_new_tokens
            for _ in range(num_new_tokens):
                self.itl.observe(gap)
        t.last_token = now

    def on_finished(self, t: RequestTimes, now: float, reason: str) -> None:
        self.e2e.observe(now - t.arrival)
        if t.scheduled is not None:
            self.queue.observe(t.scheduled - t.arrival)
            if t.first_token is not None:
                last = t.last_token if t.last_token is not None else t.first_token
                self.prefill.observe(t.first_token - t.scheduled)
                self.decode.observe(last - t.first_token)
                self.inference.observe(last - t.scheduled)
        self.finished[reason] = self.finished.get(reason, 0) + 1
