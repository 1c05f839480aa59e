"""Replicas on a real local Ray cluster (2 CPUs, loopback): 2 engine replicas of the bundled model with 1 thread
each, behind the ingress, driven by the official openai client. `pytest -q -m ray` (needs pagedserve[ray]).

Every wait is bounded; the assertions are on order, events and counts, never on wall time.
"""

from __future__ import annotations

import concurrent.futures
import re
import socket
import time

import httpx
import openai
import pytest
from conftest import run_to_completion

from pagedserve.engine.async_engine import AdmissionLimits
from pagedserve.engine.config import make_config
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.tokenizer import apply_chat_template
from pagedserve.server.config import ReplicaConfig, ServerConfig

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

MODEL = "smollm2-ray"
BOUND_S = 180  # any single request, or a replica's replacement, must be done within this
DEPLOYED: dict = {}  # the cluster fixture's build_app arguments, for a test that redeploys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, what: str, bound_s: float = BOUND_S):
    deadline = time.monotonic() + bound_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"not within {bound_s} s: {what}"
        time.sleep(0.25)


@pytest.fixture(scope="module")
def cluster(smollm):
    from pagedserve.server.ray_app import build_app

    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = make_config(model=smollm.path, dtype="float32", quantization="none", device="cpu", num_blocks=256,
                             max_num_seqs=8)  # dense, as make_engine: outputs compare exactly
        server = ServerConfig(MODEL, AdmissionLimits(max_waiting_requests=4), port=port)
        DEPLOYED.update(config=config, server=server)
        serve.run(build_app(config, server, ReplicaConfig(replicas=2, threads=1, health_check_period_s=1.0)),
                  name="pagedserve", route_prefix="/", blocking=False)
        base = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            try:
                return httpx.get(f"{base}/ready", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, "the ingress answers /ready")
        yield base
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture()
def client(cluster):
    return openai.OpenAI(base_url=f"{cluster}/v1", api_key="none", max_retries=0, timeout=BOUND_S)


def replica_gauges(base: str, name: str = "vllm:kv_cache_usage_perc") -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return {m[0]: float(m[1]) for m in re.findall(name + r'\{[^}]*replica="([^"]+)"[^}]*\} ([0-9.e+-]+)', text)}


def engine_replica_actors() -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith("SERVE_REPLICA::") and "PagedServeEngine" in a["name"])


def test_outputs_equal_the_single_engine_streamed_and_not(client, make_engine, smollm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    engine = make_engine(num_blocks=64)
    engine.add_request("x", apply_chat_template(smollm.tokenizer, messages), SamplingParams(max_tokens=20,
                                                                                            temperature=0))
    offline = run_to_completion(engine)["x"]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert resp.choices[0].message.content == offline["text"]
    assert resp.usage.completion_tokens == len(offline["tokens"])
    assert resp.usage.prompt_tokens_details is not None and resp.usage.prompt_tokens_details.cached_tokens >= 0
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant" and len({c.id for c in chunks}) == 1
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == offline["text"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(offline["tokens"])
    # the same prompt again: its prefix is cached where the router sends it, and usage says so
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16
    comp = client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=8, temperature=0)
    engine.add_request("y", "1, 2, 3, 4, 5,", SamplingParams(max_tokens=8, temperature=0))
    assert comp.choices[0].text == run_to_completion(engine)["y"]["text"]


def test_errors_keys_and_metrics_are_the_single_servers(cluster, client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    r = httpx.post(f"{cluster}/v1/chat/completions", json={"messages": "not a list"}, timeout=30)
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    text = httpx.get(f"{cluster}/metrics", timeout=30).text
    assert "vllm:request_success_total" in text
    wait_for(lambda: len(replica_gauges(cluster)) == 2, "both replicas in /metrics")


def test_request_ids_pass_through_the_ingress(cluster):
    """An incoming X-Request-Id comes back as sent through Ray's proxy and our ingress (one header, not two); one is
    made when none is sent."""
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    r = httpx.post(f"{cluster}/v1/completions", json=body, headers={"X-Request-Id": "lb-1234.abc"}, timeout=BOUND_S)
    assert r.status_code == 200 and r.headers.get_list("x-request-id") == ["lb-1234.abc"]
    r = httpx.post(f"{cluster}/v1/completions", json=body, timeout=BOUND_S)
    assert r.status_code == 200 and len(r.headers.get_list("x-request-id")) == 1 and r.headers["x-request-id"]


def test_overload_is_429_with_retry_after_never_5xx(cluster):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 48,
            "temperature": 0, "ignore_eos": True}

    def one(_):
        with httpx.Client(timeout=BOUND_S) as c:
            r = c.post(f"{cluster}/v1/chat/completions", json=body)
            return r.status_code, r.headers.get("retry-after"), r.json()  # a 200 is whole: JSON with usage

    with concurrent.futures.ThreadPoolExecutor(48) as pool:
        results = list(pool.map(one, range(48)))
    codes = [c for c, _, _ in results]
    assert all(c in (200, 429) for c in codes), codes
    refused = [(ra, b) for c, ra, b in results if c == 429]
    assert refused and codes.count(200) >= 2  # some refused, some served: both replicas' queues filled first
    assert all(b["usage"]["completion_tokens"] == 48 for c, _, b in results if c == 200)
    for ra, b in refused:
        assert int(ra) >= 1 and b["error"]["code"] == "server_overloaded"


def test_killing_a_replica_mid_load(cluster, client):
    wait_for(lambda: all(v == 0 for v in replica_gauges(cluster).values()), "idle replicas")
    before = engine_replica_actors()
    assert len(before) == 2

    def one(i: int):
        kw = dict(model=MODEL, messages=[{"role": "user", "content": f"Story number {i}, please."}],
                  max_tokens=64, temperature=0, extra_body={"ignore_eos": True})
        try:
            if i % 2:
                n = sum(1 for c in client.chat.completions.create(stream=True, **kw) if c.choices)
                return "ok", n
            return "ok", client.chat.completions.create(**kw).usage.completion_tokens
        except openai.APIStatusError as e:
            return "error", e.status_code, (e.body or {}).get("code") if isinstance(e.body, dict) else None
        except openai.APIError as e:  # an error event inside a stream that had started
            return "error", "stream", (e.body or {}).get("code") if isinstance(e.body, dict) else None

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(one, i) for i in range(16)]
        wait_for(lambda: sum(replica_gauges(cluster, "vllm:num_requests_running").values()) >= 4,
                 "requests running on the replicas")
        victim = ray.get_actor(before[0], namespace="serve")
        ray.kill(victim, no_restart=True)
        results = [f.result(timeout=BOUND_S) for f in futures]  # 0 hung: every request ends within the bound
    errors = [r for r in results if r[0] == "error"]
    assert all(r[2] in ("replica_died", "server_overloaded") for r in errors), errors  # every failure coded
    assert len(results) > len(errors)  # the survivor's requests completed (how many: where the router sent them)
    print("kill: results", sorted(map(str, results)))
    # new requests succeed at once (the router stopped using the dead replica) ...
    for _ in range(4):
        assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, temperature=0).usage.completion_tokens == 4
    # ... Ray replaces it, and the replacement serves (it publishes stats once it is up)
    after = wait_for(lambda: (a := engine_replica_actors()) and len(a) == 2 and before[0] not in a and a,
                     "a replacement replica")
    new = [a for a in after if a not in before]
    assert len(new) == 1
    new_id = new[0].split("#")[-1]
    wait_for(lambda: new_id in replica_gauges(cluster), "the replacement in the router's stats")
    # no leaked blocks on the survivor (nor anywhere): every replica's KV cache is free again when idle
    wait_for(lambda: (g := replica_gauges(cluster)) and len(g) == 2 and all(v == 0 for v in g.values()),
             "every block freed")


def test_a_replica_scaled_down_finishes_its_streams(cluster, client):
    """Ray stops one of two replicas while streams run on both (a scale-down: the same drain as a redeploy or a
    drained node): it leaves routing first and lets its requests finish (graceful_shutdown_timeout_s is
    --shutdown-timeout-s), so every stream ends in full with [DONE], and requests sent meanwhile are served.
    Last in the module: it leaves one replica."""
    from pagedserve.server.ray_app import build_app

    wait_for(lambda: (g := replica_gauges(cluster)) and len(g) == 2 and all(v == 0 for v in g.values()),
             "two idle replicas")

    def stream(i: int):  # a prompt shorter than a block: no cached prefix pulls it anywhere, load decides
        chunks = list(client.completions.create(
            model=MODEL, prompt=f"Tale {i}:", max_tokens=64, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        return chunks[-1].usage.completion_tokens, finish

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        streams = [pool.submit(stream, i) for i in range(8)]
        wait_for(lambda: (g := replica_gauges(cluster, "vllm:num_requests_running")) and len(g) == 2 and
                 all(v >= 1 for v in g.values()), "streams running on both replicas")
        serve.run(build_app(DEPLOYED["config"], DEPLOYED["server"],
                            ReplicaConfig(replicas=1, threads=1, health_check_period_s=1.0)),
                  name="pagedserve", route_prefix="/", blocking=False)
        for _ in range(4):  # during the drain: served by the replica that stays
            assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=4, temperature=0).usage.completion_tokens == 4
        results = [f.result(timeout=BOUND_S) for f in streams]
    # no error event (the client would raise): each finished in full
    assert results == [(64, ["length"])] * 8, results
    wait_for(lambda: len(engine_replica_actors()) == 1, "the scaled-down replica gone")
