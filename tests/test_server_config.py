"""server/config.py: the server's and the fleet's options refuse what they cannot serve before anything starts, and
the API-key list is parsed once. (The OTLP endpoint's checks are in tests/test_tracing.py.)"""

from __future__ import annotations

import math

import pytest

from pagedserve.server.config import ReplicaConfig, ServerConfig


def test_api_keys_are_split_on_commas_and_trimmed():
    assert ServerConfig("m", api_key=" sk-a, sk-b ,,sk-c").api_keys() == ("sk-a", "sk-b", "sk-c")
    assert ServerConfig("m").api_keys() == ()


@pytest.mark.parametrize("name", ["served_model_name", "host", "api_key"])
@pytest.mark.parametrize("blank", ["", " ", " , ,"])
def test_blank_names_are_refused(name, blank):
    with pytest.raises(ValueError, match=f"{name} must not be empty"):
        ServerConfig(**{"served_model_name": "m", name: blank})


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_body_bytes=0), "max_body_bytes must be >= 1"),
    (dict(body_timeout_s=0.0), "body_timeout_s must be > 0"),
    (dict(body_timeout_s=math.inf), "body_timeout_s must be > 0"),
    (dict(header_timeout_s=-1.0), "header_timeout_s must be > 0"),
    (dict(keep_alive_timeout_s=-1), "keep_alive_timeout_s must be >= 0"),
    (dict(max_connections=0), "max_connections must be >= 1"),
    (dict(shutdown_timeout_s=-0.5), "shutdown_timeout_s must be >= 0"),
    (dict(max_output_tokens=0), "max_output_tokens must be >= 1"),
    (dict(log_level="loud"), "log_level must be one of"),
])
def test_server_bounds(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ServerConfig("m", **kwargs)


def test_server_edges_and_optional_limits_are_accepted():
    ServerConfig("m", max_body_bytes=1, keep_alive_timeout_s=0, shutdown_timeout_s=0, max_connections=1,
                 max_output_tokens=1, log_level="trace")
    ServerConfig("m", max_connections=None, max_output_tokens=None)  # None: no cap


@pytest.mark.parametrize("kwargs, match", [
    (dict(replicas=0), "replicas must be >= 1"),
    (dict(threads=0), "threads must be >= 1"),
    (dict(router="random"), "router must be one of prefix, pow2"),
])
def test_replica_bounds(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ReplicaConfig(**kwargs)


def test_replica_defaults_mean_one_engine_in_this_process():
    c = ReplicaConfig()
    assert c.replicas is None and c.router == "prefix" and c.ingress_cpus == 0.0
    assert ReplicaConfig(replicas=2, router="pow2", threads=1).replicas == 2
