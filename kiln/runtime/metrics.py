"""Prometheus metrics of the server (`GET /metrics`), through `prometheus_client`: one registry per
server, so tests and several servers in one process do not share counts."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # noqa: F401  (re-exported for the server)

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kiln_requests", "Finished requests, by finish reason", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("kiln_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("kiln_generation_tokens", "Generated tokens", registry=r)
        self.time_to_first_token = Histogram("kiln_time_to_first_token_seconds", "From arrival to the first token",
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram("kiln_inter_token_latency_seconds", "Between a request's tokens",
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.request_latency = Histogram("kiln_request_latency_seconds", "From arrival to the last token",
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge("kiln_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("kiln_requests_waiting", "Requests queued for admission", registry=r)
        self.kv_cache_usage = Gauge("kiln_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
