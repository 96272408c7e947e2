"""The sandbox pool's Prometheus metrics (GET /metrics of hybridflow.agents.server): how many requests of each kind
came and how many sessions are open, nothing a caller sent."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest


class PoolMetrics:
    """Requests by kind and open sessions, in a registry of this server's own (a test may run several in one
    process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("hybridflow_environment_requests", "Authenticated requests served, by kind "
                                "(tool, reward, program, open, step, close) and outcome code.", ["kind", "code"],
                                registry=self.registry)
        self.refused = Counter("hybridflow_environment_refused_requests", "Requests refused for a missing or "
                               "wrong token.", registry=self.registry)
        self.reaped = Counter("hybridflow_environment_reaped_sessions", "Sessions closed for being idle longer "
                              "than the server's idle limit (their rollout stopped stepping them).",
                              registry=self.registry)
        self.expired = Counter("hybridflow_environment_expired_sessions", "Sessions closed for being older than "
                               "the server's session lifetime.", registry=self.registry)
        self.open_sessions = Gauge("hybridflow_environment_open_sessions", "Environment sessions open now.",
                                   registry=self.registry)

    def text(self) -> bytes:
        return generate_latest(self.registry)
