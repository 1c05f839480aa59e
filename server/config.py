"""The server's options (the CLI builds its flags from these fields, as it does from the engine's)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.engine.async_engine import AdmissionLimits
from pagedserve.engine.config import opt


@dataclass
class ServerConfig:
    served_model_name: str | None = opt(None, "model name clients send and /v1/models lists "
                                              "(default: the model file's name)")
    limits: AdmissionLimits = field(default_factory=AdmissionLimits)
    host: str = opt("127.0.0.1", "address to listen on")
    port: int = opt(8000, "port to listen on")
    log_level: str = opt("info", "uvicorn log level")
    api_key: str | None = opt(None, "comma-separated API keys that /v1/* and /metrics require as Bearer tokens "
                                    "(default: $PAGEDSERVE_API_KEY; none: no auth, loopback only)")
    allow_insecure_no_auth: bool = opt(False, "serve on a non-loopback address with no API key")
    prefix_cache_per_key: bool = opt(True, "with API keys: each key gets its own prefix cache, so tenants never "
                                           "share KV blocks (or learn what others sent from hit timing)")
    max_body_bytes: int = opt(8 * 2**20, "largest request body accepted; more gets 413")
    body_timeout_s: float = opt(30.0, "time allowed to receive a request body; slower gets 408")
    keep_alive_timeout_s: int = opt(5, "idle keep-alive connections are closed after this many seconds")
    header_timeout_s: float = opt(10.0, "a request's line and headers must arrive within this many seconds of the "
                                        "connection opening (or of its previous response); else it is closed")
    max_connections: int | None = opt(1024, "open connections at most: idle ones are closed to make room for new "
                                            "ones; past it with every connection busy, a new one gets 503")
    disconnect_poll_s: float = 0.1

    def api_keys(self) -> tuple[str, ...]:
        return tuple(k.strip() for k in (self.api_key or "").split(",") if k.strip())
