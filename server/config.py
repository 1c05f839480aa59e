"""The server's options (the CLI builds its flags from these fields, as it does from the engine's)."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from ..engine.async_engine import AdmissionLimits
from ..engine.config import check_options, opt


@dataclass
class ServerConfig:
    served_model_name: str | None = opt(None, "model name clients send and /v1/models lists "
                                              "(default: the model file's name)")
    limits: AdmissionLimits = field(default_factory=AdmissionLimits)
    host: str = opt("127.0.0.1", "address to listen on")
    port: int = opt(8000, "port to listen on")
    log_level: str = opt("info", "uvicorn log level",
                         choices=("critical", "error", "warning", "info", "debug", "trace"))
    api_key: str | None = opt(None, "comma-separated API keys that /v1/* and /metrics require as Bearer tokens "
                                    "(default: $PAGEDSERVE_API_KEY; none: no auth, loopback only)")
    allow_insecure_no_auth: bool = opt(False, "serve on a non-loopback address with no API key")
    prefix_cache_per_key: bool = opt(True, "with API keys: each key gets its own prefix cache, so tenants never "
                                           "share KV blocks (or learn what others sent from hit timing)")
    max_body_bytes: int = opt(8 * 2**20, "largest request body accepted; more gets 413", bound=">= 1")
    body_timeout_s: float = opt(30.0, "time allowed to receive a request body; slower gets 408", bound="> 0")
    keep_alive_timeout_s: int = opt(5, "idle keep-alive connections are closed after this many seconds",
                                    bound=">= 0")
    header_timeout_s: float = opt(10.0, "a request's line and headers must arrive within this many seconds of the "
                                        "connection opening (or of its previous response); else it is closed",
                                  bound="> 0")
    max_connections: int | None = opt(1024, "open connections at most: idle ones are closed to make room for new "
                                            "ones; past it with every connection busy, a new one gets 503",
                                    bound=">= 1")
    shutdown_timeout_s: float = opt(20.0, "on SIGTERM or Ctrl-C: how long requests in flight may run on while no new "
                                          "ones are admitted; those still running then end with an error event "
                                          "(streams) or a 503 (a second signal stops at once)", bound=">= 0")
    otlp_traces_endpoint: str | None = opt(None, "send an OpenTelemetry span per request (OTLP over HTTP) to this "
                                                 "collector, e.g. http://127.0.0.1:4318 (needs pagedserve[otel])")
    max_output_tokens: int | None = opt(None, "most tokens one request may generate: a larger max_tokens gets 400, "
                                              "and a chat request without one gets this many at most (default: "
                                              "no limit but the context)", bound=">= 1")
    disconnect_poll_s: float = 0.1

    def __post_init__(self) -> None:
        check_options(self)
        for name in ("served_model_name", "host", "api_key"):
            if getattr(self, name) is not None and not getattr(self, name).strip(" ,"):
                raise ValueError(f"{name} must not be empty")
        endpoint = self.otlp_traces_endpoint
        if endpoint is not None and (urlsplit(endpoint).scheme not in ("http", "https") or
                                     not urlsplit(endpoint).hostname):
            raise ValueError(f"otlp_traces_endpoint must be an http:// or https:// URL, got {endpoint!r}")

    def api_keys(self) -> tuple[str, ...]:
        return tuple(k.strip() for k in (self.api_key or "").split(",") if k.strip())


@dataclass(frozen=True)
class ReplicaConfig:
    """Serving past one process: engine replicas on Ray Serve (server/ray_app.py; needs `pagedserve[ray]`)."""

    replicas: int | None = opt(None, "serve with this many engine replicas on Ray Serve, behind one ingress with a "
                                     "prefix-cache-aware router (default: one engine in this process, no Ray)",
                                bound=">= 1")
    ray_address: str | None = opt(None, "with --replicas: the Ray cluster to join, `auto` (one started with `ray "
                                        "start`) or HOST:PORT (default: start a local one)")
    threads: int | None = opt(None, "with --replicas: CPU threads per replica, also the CPUs Ray reserves for each "
                                    "(default: this machine's cores / replicas)", bound=">= 1")
    router: str = opt("prefix", "with --replicas: how requests pick a replica: `prefix` (longest cached prefix "
                                "unless load is imbalanced) or `pow2` (Ray's default)", choices=("prefix", "pow2"))
    ingress_cpus: float = 0.0  # the ingress tokenizes and relays; it reserves no CPU from the replicas
    health_check_period_s: float = 2.0  # how soon Ray notices a dead replica and replaces it
    routing_stats_period_s: float = 0.5  # how often replicas publish their load to the router
    router_kwargs: dict = field(default_factory=dict)  # PrefixAffinity's thresholds

    def __post_init__(self) -> None:
        check_options(self)
