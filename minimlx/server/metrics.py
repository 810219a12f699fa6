"""Prometheus' `/metrics`: requests by endpoint and status, tokens in and out, time to first token and between
tokens, running and waiting requests (over every loaded model), the prompt caches' hits and bytes, the models loaded
and the memory each holds.

Each server has a registry of its own (`prometheus_client`), fed by the access log's record of each finished request
(`observe`) and read live from the engine for what is true now (running, waiting, cache bytes).
"""

from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from starlette.requests import Request as HTTPRequest
from starlette.responses import Response

from .access_log import RequestRecord

if TYPE_CHECKING:
    from .models import Models

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class Metrics:
    """The server's metrics, registered in their own registry."""

    def __init__(self, models: "Models", endpoints: frozenset[str] = frozenset()):
        self.endpoints = endpoints  # the paths counted by name; any other is "other" (no label per stray path)
        self.registry = registry = CollectorRegistry()
        self.requests = Counter(
            "minimlx_requests",
            "HTTP requests answered, by endpoint and status",
            ["endpoint", "status"],
            registry=registry,
        )
        self.prompt_tokens = Counter("minimlx_prompt_tokens", "Prompt tokens of the answers started", registry=registry)
        self.cached_tokens = Counter(
            "minimlx_cached_prompt_tokens", "Prompt tokens the prompt cache supplied", registry=registry
        )
        self.generated_tokens = Counter("minimlx_generation_tokens", "Tokens generated", registry=registry)
        self.cache_hits = Counter(
            "minimlx_prompt_cache_hits", "Answers whose prompt started from the prompt cache", registry=registry
        )
        self.first_token = Histogram(
            "minimlx_time_to_first_token_seconds",
            "From a request's arrival to its first generated token",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.between_tokens = Histogram(
            "minimlx_inter_token_latency_seconds",
            "Between one generated token and the next, per answer",
            buckets=TOKEN_BUCKETS,
            registry=registry,
        )
        self.models = models
        engines, caches = self.engines, self.prompt_caches
        Gauge("minimlx_requests_running", "Answers being prefilled or decoded", registry=registry).set_function(
            lambda: sum(e.running for e in engines())
        )
        Gauge("minimlx_requests_waiting", "Requests waiting for a batch slot", registry=registry).set_function(
            lambda: sum(len(e.waiting) for e in engines())
        )
        Gauge("minimlx_prompt_cache_bytes", "Bytes the prompt cache holds", registry=registry).set_function(
            lambda: sum(c.nbytes for cache in caches() for _, entry in cache.entries for c in entry)
        )
        Gauge("minimlx_prompt_cache_entries", "Prompts the prompt cache holds", registry=registry).set_function(
            lambda: sum(len(cache.entries) for cache in caches())
        )
        Gauge("minimlx_models_loaded", "Models loaded", registry=registry).set_function(lambda: len(models.loaded))
        registry.register(ModelMemory(models))

    def engines(self) -> list:
        return [served.engine for served in list(self.models.loaded.values())]

    def prompt_caches(self) -> list:
        return [engine.prompt_cache for engine in self.engines() if engine.prompt_cache is not None]

    def observe(self, record: RequestRecord) -> None:
        """Count one finished request (called by the access log once its response is over)."""
        endpoint = record.path.split("?", 1)[0]
        endpoint = endpoint if endpoint in self.endpoints else "other"
        self.requests.labels(endpoint=endpoint, status=str(record.status)).inc()
        answer = record.answer
        if answer is None:
            return
        usage = answer.usage()
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.cached_tokens.inc(usage.cached_tokens)
        self.generated_tokens.inc(usage.completion_tokens)
        self.cache_hits.inc(usage.cached_tokens > 0)
        if answer.first_output_at is not None:
            self.first_token.observe(answer.first_output_at - record.started)
        for gap in answer.token_gaps:
            self.between_tokens.observe(gap)

    async def endpoint(self, request: HTTPRequest) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class ModelMemory:
    """`minimlx_model_memory_bytes{model=...}`: the bytes of each loaded model's weights, read when scraped (models
    come and go)."""

    def __init__(self, models: "Models"):
        self.models = models

    def collect(self):
        family = GaugeMetricFamily("minimlx_model_memory_bytes", "Bytes of a loaded model's weights", labels=["model"])
        for name, served in list(self.models.loaded.items()):
            family.add_metric([name], served.card.size)
        yield family
