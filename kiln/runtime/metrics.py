"""Prometheus metrics of the server (`GET /metrics`), through `prometheus_client`: one registry per
server, so tests and several servers in one process do not share counts.

Each figure is exported twice: under kiln's names and under vLLM's (`vllm:num_requests_waiting`,
`vllm:kv_cache_usage_perc`, ... labelled by `model_name`), so that routers and dashboards written for
vLLM (the Gateway API Inference Extension, llm-d, Grafana boards) read kiln unchanged. The two are
updated together, by the methods below, never one without the other. Two vLLM names are older
aliases of another figure, kept for the boards still reading them: `vllm:gpu_cache_usage_perc` (of
`vllm:kv_cache_usage_perc`) and `vllm:time_per_output_token_seconds` (of
`vllm:inter_token_latency_seconds`)."""

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # noqa: F401  (re-exported for the server)

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
"""vLLM's buckets of the time to the first token."""
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
"""vLLM's buckets between tokens, and four below its 10 ms (a small model's CPU decode)."""
REQUEST_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
"""vLLM's buckets of a request's times (end to end, queued, prefill, decode, inference, up to 7,680 s), and five
below its 0.3 s."""
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
"""vLLM's buckets of the tokens an engine step runs."""
N_BUCKETS = (1, 2, 5, 10, 20)
"""vLLM's buckets of a request's `n`."""


def token_buckets(max_model_len: int | None) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to the model's context (vLLM's buckets of a request's token counts)."""
    top, buckets, scale = max_model_len or 100_000, [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > top:
                return tuple(buckets)
            buckets.append(step * scale)
        scale *= 10


class Metrics:
    def __init__(self, model_name: str = "kiln", block_size: int | None = None, num_blocks: int | None = None,
                 max_model_len: int | None = None, cache_dtype: str = "auto") -> None:
        self.registry = r = CollectorRegistry()
        m = ["model_name"]
        self.model_name = model_name
        tokens = token_buckets(max_model_len)
        self.requests = Counter("kiln_requests", "Finished requests, by finish reason", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("kiln_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("kiln_generation_tokens", "Generated tokens", registry=r)
        self.time_to_first_token = Histogram("kiln_time_to_first_token_seconds", "From arrival to the first token",
                                             buckets=TTFT_BUCKETS, registry=r)
        self.inter_token_latency = Histogram("kiln_inter_token_latency_seconds", "Between a request's tokens",
                                             buckets=ITL_BUCKETS, registry=r)
        self.request_latency = Histogram("kiln_request_latency_seconds", "From arrival to the last token",
                                         buckets=REQUEST_BUCKETS, registry=r)
        self.running = Gauge("kiln_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("kiln_requests_waiting", "Requests queued for admission", registry=r)
        self.kv_cache_usage = Gauge("kiln_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use", registry=r)
        self.queue_time = Histogram("kiln_request_queue_time_seconds",
                                    "From arrival to the scheduler's first admission into the running batch",
                                    buckets=REQUEST_BUCKETS, registry=r)
        self._twins = {  # (kiln's, vLLM's), observed together
            name: (Histogram(f"kiln_{name}", text, buckets=buckets, registry=r),
                   Histogram(f"vllm:{name}", text, m, buckets=buckets, registry=r))
            for name, text, buckets in (
                ("iteration_tokens_total", "Tokens per engine step (prefill chunks and decodes)", ITERATION_BUCKETS),
                ("request_prefill_time_seconds", "From a request's admission to its first token", REQUEST_BUCKETS),
                ("request_decode_time_seconds", "From a request's first token to its last", REQUEST_BUCKETS),
                ("request_inference_time_seconds", "From a request's admission to its last token", REQUEST_BUCKETS),
                ("request_params_n", "The n of each finished request (its choices)", N_BUCKETS),
                ("request_params_max_tokens", "The max_tokens of each finished sequence", tokens),
                ("request_max_num_generation_tokens", "The most tokens any choice of a finished request generated",
                 tokens))}
        self.preemptions = Counter("kiln_num_preemptions", "Sequences preempted for want of KV blocks", registry=r)
        self.prefix_cache_queries = Counter("kiln_prefix_cache_queries",
                                            "Tokens of admitted sequences looked up in the prefix cache", registry=r)
        self.prefix_cache_hits = Counter("kiln_prefix_cache_hits", "Tokens found in the prefix cache", registry=r)

        self._vllm = {
            "running": Gauge("vllm:num_requests_running", "Requests in model execution batches", m, registry=r),
            "waiting": Gauge("vllm:num_requests_waiting", "Requests waiting to be processed", m, registry=r),
            "kv": Gauge("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent", m, registry=r),
            "gpu_cache": Gauge("vllm:gpu_cache_usage_perc", "KV-cache usage; 1 means 100 percent (older name)", m,
                               registry=r),
            "preemptions": Counter("vllm:num_preemptions", "Cumulative number of preemptions", m, registry=r),
            "prefix_queries": Counter("vllm:prefix_cache_queries", "Prefix cache queries, in queried tokens", m,
                                      registry=r),
            "prefix_hits": Counter("vllm:prefix_cache_hits", "Prefix cache hits, in cached tokens", m, registry=r),
            "prompt": Counter("vllm:prompt_tokens", "Prefill tokens processed", m, registry=r),
            "generation": Counter("vllm:generation_tokens", "Generation tokens processed", m, registry=r),
            "success": Counter("vllm:request_success", "Finished requests", m + ["finished_reason"], registry=r),
            "ttft": Histogram("vllm:time_to_first_token_seconds", "Time to first token", m,
                              buckets=TTFT_BUCKETS, registry=r),
            "itl": Histogram("vllm:inter_token_latency_seconds", "Inter-token latency", m,
                             buckets=ITL_BUCKETS, registry=r),
            "tpot": Histogram("vllm:time_per_output_token_seconds", "Time per output token (older name of the "
                              "inter-token latency)", m, buckets=ITL_BUCKETS, registry=r),
            "queue": Histogram("vllm:request_queue_time_seconds", "Time spent in WAITING phase for request", m,
                               buckets=REQUEST_BUCKETS, registry=r),
            "e2e": Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", m,
                             buckets=REQUEST_BUCKETS, registry=r),
            "request_prompt": Histogram("vllm:request_prompt_tokens", "Prompt tokens per finished request", m,
                                        buckets=tokens, registry=r),
            "request_generation": Histogram("vllm:request_generation_tokens", "Generated tokens per finished request",
                                            m, buckets=tokens, registry=r),
        }
        for name, metric in self._vllm.items():  # each series reads 0 before its first event, as in vLLM
            if name != "success":
                metric.labels(model_name=model_name)
        for _, vllm_twin in self._twins.values():
            vllm_twin.labels(model_name=model_name)
        if block_size is not None:  # the routers' optional BlockSize, as vLLM reports it
            Gauge("vllm:cache_config_info", "Information of the KV-cache configuration",
                  ["block_size", "num_gpu_blocks", "cache_dtype"], registry=r).labels(
                      str(block_size), str(num_blocks), cache_dtype).set(1)
        # vLLM's LoRA gauge, as it reads with no adapters: kiln serves none, but boards and routers expect it.
        Gauge("vllm:lora_requests_info", "Running stats on LoRA requests",
              ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
              registry=r).labels("0", "", "").set(time.time())

    def _v(self, name: str, **labels: str):
        return self._vllm[name].labels(model_name=self.model_name, **labels)

    def admitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self._v("prompt").inc(prompt_tokens)

    def token(self, since_arrival: float, since_last: float | None) -> None:
        """One generated token; `since_last` is None for a request's first."""
        self.generation_tokens.inc()
        self._v("generation").inc()
        if since_last is None:
            self.time_to_first_token.observe(since_arrival)
            self._v("ttft").observe(since_arrival)
        else:
            self.inter_token_latency.observe(since_last)
            self._v("itl").observe(since_last)
            self._v("tpot").observe(since_last)

    def _observe(self, name: str, value: float) -> None:
        kiln_twin, vllm_twin = self._twins[name]
        kiln_twin.observe(value)
        vllm_twin.labels(model_name=self.model_name).observe(value)

    def finished(self, reason: str, latency: float | None = None, prompt_tokens: int = 0,
                 generation_tokens: int = 0, prefill: float | None = None, decode: float | None = None,
                 max_tokens: int | None = None) -> None:
        """A request ended: `reason` is stop, length or abort (an abort has no latency recorded); `prefill`
        from its admission to its first token and `decode` from there to its last, as vLLM times them."""
        self.requests.labels(reason).inc()
        self._v("success", finished_reason=reason).inc()
        if latency is not None:
            self.request_latency.observe(latency)
            self._v("e2e").observe(latency)
            self._v("request_prompt").observe(prompt_tokens)
            self._v("request_generation").observe(generation_tokens)
        if prefill is not None and decode is not None:
            self._observe("request_prefill_time_seconds", prefill)
            self._observe("request_decode_time_seconds", decode)
            self._observe("request_inference_time_seconds", prefill + decode)
        if max_tokens is not None:
            self._observe("request_params_max_tokens", max_tokens)

    def request_finished(self, n: int, most_generated: int) -> None:
        """All `n` choices of one request ended (none aborted), the longest after `most_generated` tokens."""
        self._observe("request_params_n", n)
        self._observe("request_max_num_generation_tokens", most_generated)

    def step(self, tokens: int) -> None:
        """The engine ran a step of `tokens` tokens."""
        self._observe("iteration_tokens_total", tokens)

    def scheduled(self, queue_time: float) -> None:
        """A request entered the running batch for the first time, `queue_time` seconds after its arrival."""
        self.queue_time.observe(queue_time)
        self._v("queue").observe(queue_time)

    def scheduler_state(self, running: int, waiting: int, kv_usage: float) -> None:
        for kiln_gauge, vllm_name, value in ((self.running, "running", running), (self.waiting, "waiting", waiting),
                                             (self.kv_cache_usage, "kv", kv_usage)):
            kiln_gauge.set(value)
            self._v(vllm_name).set(value)
        self._v("gpu_cache").set(kv_usage)

    def scheduler_counts(self, preemptions: int, prefix_cache_queries: int, prefix_cache_hits: int) -> None:
        """What the scheduler's counters grew by since the last call (they live in the scheduler, which
        knows nothing of metrics)."""
        for kiln_counter, vllm_name, value in ((self.preemptions, "preemptions", preemptions),
                                               (self.prefix_cache_queries, "prefix_queries", prefix_cache_queries),
                                               (self.prefix_cache_hits, "prefix_hits", prefix_cache_hits)):
            if value:
                kiln_counter.inc(value)
                self._v(vllm_name).inc(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
