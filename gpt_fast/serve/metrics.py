"""The server's metrics, in Prometheus's text exposition format (``GET /metrics``), through ``prometheus_client``.

Each server has a registry of its own (never the library's global one), so that several servers live in one
process. What the batcher knows (its slots and queue, the KV cache's blocks, the prefix cache, the tokens generated)
is read when the metrics are scraped (:class:`BatcherCollector`), so it is always current. The rest is measured
from each request's events (:class:`RequestObserver`), which arrive on the batcher's thread: prometheus_client's
counters and histograms are thread-safe, and a request's own timings are touched only there.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder

from gpt_fast.engine.batcher import Batcher, Delta, Event, Failed, Finished, PromptLogprobs

PREFIX = "gpt_fast_"
# Time to first token and between tokens: 1 ms (a decode step on a GPU) to 60 s (a long queue).
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
# A whole request: 10 ms (a token or two) to 10 minutes (a long answer on a busy server).
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
FINISH_REASONS = ("stop", "length", "cancelled")  # the batcher's (an answer of tool calls ends with "stop")


class BatcherCollector:
    """The batcher's figures at the moment of a scrape: its requests, its KV cache and prefix cache, its tokens."""

    def __init__(self, batcher: Batcher) -> None:
        self.batcher = batcher

    def collect(self) -> Iterator[Metric]:
        batcher = self.batcher
        usage = batcher.cache_usage()
        yield gauge("requests_running", "Requests in a slot of the batch, being decoded.", batcher.busy)
        yield gauge("requests_waiting", "Requests queued for a free slot.", batcher.queued)
        yield counter("generation_tokens", "Tokens generated, a stop token included.", batcher.tokens_generated)
        yield gauge("kv_cache_block_size_tokens", "Tokens in a block of the KV cache.", usage.block_size)
        yield gauge("kv_cache_blocks", "Blocks of the KV cache the sequences may hold.", usage.blocks)
        yield gauge("kv_cache_blocks_used", "KV cache blocks held by the requests in the slots.", usage.blocks_used)
        used = usage.blocks_used / usage.blocks if usage.blocks else 0.0
        yield gauge("kv_cache_usage_ratio", "Fraction of the KV cache's blocks in use (0 to 1).", used)
        queried, hit = usage.prefix_tokens_queried, usage.prefix_tokens_hit
        yield counter("prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache.", queried)
        yield counter("prefix_cache_hit_tokens", "Prompt tokens found already computed in the prefix cache.", hit)
        hit_rate = "Fraction of the prompt tokens looked up that the prefix cache held (0 before any lookup)."
        yield gauge("prefix_cache_hit_ratio", hit_rate, hit / queried if queried else 0.0)
        yield counter("preemptions", "Requests taken out of their slot to free blocks.", usage.preemptions)


def gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, documentation, value=value)


def counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    """A counter read from the batcher (exposed as ``NAME_total``)."""
    return CounterMetricFamily(PREFIX + name, documentation, value=value)


def histogram(
    registry: CollectorRegistry, name: str, documentation: str, buckets: tuple[float, ...] = TOKEN_BUCKETS
) -> Histogram:
    """A histogram of a request's latency, in seconds."""
    return Histogram(PREFIX + name, documentation, buckets=buckets, registry=registry)


class ServerMetrics:
    """One server's metrics: the batcher's, read at scrape time, and those measured from its requests' events."""

    def __init__(self, batcher: Batcher) -> None:
        self.registry = registry = CollectorRegistry()
        registry.register(BatcherCollector(batcher))
        prompt = "Prompt tokens of the requests prefilled (counted at their first token, or their prompt's scores)."
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", prompt, registry=registry)
        ended = "Requests ended, by the batcher's finish reason."
        self.finished = Counter(PREFIX + "requests_finished", ended, ["reason"], registry=registry)
        for reason in FINISH_REASONS:  # each series present from the start, at 0
            self.finished.labels(reason=reason)
        self.failed = Counter(
            PREFIX + "requests_failed",
            "Requests that failed (the server's error, or a constraint given up on).",
            registry=registry,
        )
        self.ttft = histogram(registry, "time_to_first_token_seconds", "From submission to the first token.")
        self.inter_token = histogram(registry, "inter_token_latency_seconds", "Between consecutive tokens.")
        whole = "From submission to the end (any finish reason)."
        self.e2e = histogram(registry, "e2e_request_latency_seconds", whole, REQUEST_BUCKETS)

    def observe(self, prompt_tokens: int, on_event: Callable[[Event], None]) -> RequestObserver:
        """A request's event callback that measures it, then hands each event to ``on_event``; made just before the
        request is submitted."""
        return RequestObserver(self, prompt_tokens, on_event)

    def exposition(self, accept: str) -> tuple[bytes, str]:
        """The metrics, and their content type, in the format the ``Accept`` header asks for (Prometheus's text
        format unless it asks for OpenMetrics)."""
        encode, content_type = choose_encoder(accept)
        return encode(self.registry), content_type


class RequestObserver:
    """One request's timings, measured as its events arrive (on the batcher's thread)."""

    def __init__(self, metrics: ServerMetrics, prompt_tokens: int, on_event: Callable[[Event], None]) -> None:
        self.metrics, self.prompt_tokens, self.on_event = metrics, prompt_tokens, on_event
        self.submitted = time.perf_counter()
        self.last_token: float | None = None
        self.prefilled = False

    def __call__(self, item: Event) -> None:
        now, metrics = time.perf_counter(), self.metrics
        if isinstance(item, (Delta, PromptLogprobs)) and not self.prefilled:
            self.prefilled = True
            metrics.prompt_tokens.inc(self.prompt_tokens)
        if isinstance(item, Delta):
            if self.last_token is None:
                metrics.ttft.observe(now - self.submitted)
            else:
                metrics.inter_token.observe(now - self.last_token)
            self.last_token = now
        elif isinstance(item, Finished):
            metrics.finished.labels(reason=item.finish_reason).inc()
            metrics.e2e.observe(now - self.submitted)
        elif isinstance(item, Failed):
            metrics.failed.inc()
        self.on_event(item)
