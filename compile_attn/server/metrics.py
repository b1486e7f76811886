"""Prometheus metrics of one server app (``GET /metrics``): requests running and waiting, KV cache usage, time to
first token, inter-token and end-to-end latency histograms, prompt and generated token counters, and the standard
``process_*`` metrics of the process serving HTTP (CPU seconds, memory, open files; on Linux).

Each app owns its ``CollectorRegistry`` (several apps in one process never share counters). Gauges are read from the
engine when scraped; latencies are observed as each sample's Deltas reach the HTTP handler, so they include the
engine's queueing as a client sees it (less the network).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from compile_attn.engine.serving.async_engine import AsyncLLM

from compile_attn.engine.serving.streams import Delta
from compile_attn.engine.serving.engine_pipe import EngineClient

PREFIX = "compile_attn"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5)

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics"]


class ServerMetrics:
    """The metrics of one app on ``engine`` (in this process, or behind a pipe: its ``gauges()`` are the last the
    engine sent); ``render()`` is the Prometheus text exposition."""

    def __init__(self, engine: AsyncLLM | EngineClient, model_name: str) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # the HTTP side's own process (the front end's, when apart)
        labels = {"model_name": model_name}

        def gauge(name: str, doc: str, key: str) -> None:
            g = Gauge(f"{PREFIX}_{name}", doc, list(labels), registry=self.registry)
            g.labels(**labels).set_function(lambda: engine.gauges()[key])

        gauge("num_requests_running", "Requests in the running batch (KV allocated).", "running")
        gauge("num_requests_waiting", "Requests queued for their first step (or preempted).", "waiting")
        gauge("num_requests_pending", "Requests submitted to the server and not finished.", "pending")
        gauge("kv_cache_usage_perc", "Fraction of the KV cache's token slots in use (0 to 1).", "kv_usage")
        gauge("kv_cache_capacity_tokens", "Token slots in the KV cache.", "kv_capacity_tokens")
        gauge("spec_decode_num_drafts", "Speculative decoding: request-steps that verified drafts, since start.",
              "spec_drafts")
        gauge("spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified, since start.",
              "spec_draft_tokens")
        gauge("spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted, since start.",
              "spec_accepted_tokens")

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"{PREFIX}_{name}", doc, [*labels, *extra], registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"{PREFIX}_{name}", doc, list(labels), buckets=buckets, registry=self.registry)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted HTTP requests (once per request, "
                                     "whatever its n, as usage counts them).").labels(**labels)
        self.generation_tokens = counter("generation_tokens", "Tokens generated, every sample counted.").labels(**labels)
        self._finished = counter("request_success", "Samples finished, by finish reason.", ("finished_reason",))
        self._labels = labels
        self.ttft = histogram("time_to_first_token_seconds", "From submission to a sample's first token.",
                              _LATENCY_BUCKETS).labels(**labels)
        self.itl = histogram("inter_token_latency_seconds", "Between a sample's consecutive tokens (a Delta of k tokens "
                             "after the first counts k gaps of 1/k its delay).", _ITL_BUCKETS).labels(**labels)
        self.e2e = histogram("e2e_request_latency_seconds", "From submission to a sample's last Delta.",
                             _LATENCY_BUCKETS).labels(**labels)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def count_finished(self, reason: str | None) -> None:
        """One sample finished for ``reason`` (None: aborted)."""
        self._finished.labels(**self._labels, finished_reason=reason or "abort").inc()

    def timer(self, start: float) -> SampleTimer:
        """The observer of one sample's Deltas, submitted at ``start`` (``time.perf_counter()``): call it with each
        Delta as it reaches the handler."""
        return SampleTimer(self, start)


class SampleTimer:
    """One sample's latencies and tokens into its app's metrics, a Delta at a time (a plain call per Delta, not a
    generator wrapped around the sample's stream: the streamed-token path is the front end's hottest)."""

    __slots__ = ("metrics", "start", "last", "done")

    def __init__(self, metrics: ServerMetrics, start: float) -> None:
        self.metrics, self.start, self.last, self.done = metrics, start, None, False

    def __call__(self, d: Delta) -> None:
        m = self.metrics
        now = time.perf_counter()
        n = len(d.token_ids)
        if n:
            m.generation_tokens.inc(n)
            if self.last is None:  # tokens after the first in the same Delta have no gap of their own
                m.ttft.observe(now - self.start)
            else:
                gap = (now - self.last) / n
                for _ in range(n):
                    m.itl.observe(gap)
            self.last = now
        if d.finished:
            self.done = True
            m.e2e.observe(now - self.start)
            m.count_finished(d.finish_reason)

    def abandon(self) -> None:
        """The sample's handler is done with it: if its last Delta never came (the client went away, the server
        ended it), count it as finished with reason "abort"."""
        if not self.done:
            self.done = True
            self.metrics.count_finished(None)
