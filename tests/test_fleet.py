"""The replica fleet without Ray: the Fleet's refusals, retries and coded errors over fake replicas (the Ray tier,
tests/test_ray.py, runs the real thing; the affinity policy is tests/test_affinity.py's)."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.engine.async_engine import AdmissionLimits, OverloadedError
from pagedserve.engine.output_processor import RequestMetrics, RequestOutput
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.server.affinity import RoutingKey
from pagedserve.server.fleet import Admitted, Fleet, Refused, ReplicaLostError


# ---- Fleet over fake replicas --------------------------------------------------------------------------------
class Inputs:
    tokenizer = None
    max_model_len = 128

    def validate(self, ids, params):
        return params.max_tokens


def out(rid: str, token: int, finished: bool) -> RequestOutput:
    return RequestOutput(request_id=rid, new_token_ids=[token], text=f"t{token}", finished=finished,
                         finish_reason="length" if finished else None, num_prompt_tokens=3, num_output_tokens=token,
                         num_cached_tokens=0, metrics=RequestMetrics(0.0))


class Replicas:
    """Each call takes the next scripted behaviour: 'refuse', 'die_before', 'die_after', or 'ok'."""

    def __init__(self, script: list[str], stats: dict | None = None) -> None:
        self.script, self.calls = list(script), []
        self.stats = stats if stats is not None else {"r0": {}, "r1": {}}

    async def dispatch(self, rid, ids, params, key: RoutingKey):
        what = self.script.pop(0)
        replica = f"r{len(self.calls) % 2}"
        self.calls.append((what, key.avoid))
        if what == "refuse":
            yield Refused(replica, "server overloaded: full", "queue_full")
            return
        yield Admitted(replica)
        if what == "die_before":
            raise ReplicaLostError("gone")
        yield out(rid, 1, False)
        if what == "die_after":
            raise ReplicaLostError("gone")
        yield out(rid, 2, True)


def fleet(replicas: Replicas) -> Fleet:
    return Fleet(Inputs(), replicas.dispatch, lambda: replicas.stats, AdmissionLimits(), 16)


async def run(f: Fleet) -> tuple[list[str], BaseException | None]:
    f.reserve()
    s = f.submit("req", [1, 2, 3], SamplingParams(max_tokens=2))
    texts = []
    try:
        await s.wait_started()
        async for o in s:
            texts.append(o.text)
    except BaseException as e:  # noqa: BLE001
        return texts, e
    return texts, None


def test_fleet_runs_a_request_and_retries_a_refusal_elsewhere():
    r = Replicas(["ok"])
    assert asyncio.run(run(fleet(r))) == (["t1", "t2"], None)
    r = Replicas(["refuse", "ok"])
    assert asyncio.run(run(fleet(r))) == (["t1", "t2"], None)
    assert r.calls == [("refuse", ()), ("ok", ("r0",))]  # the refuser is ranked last on the retry


def test_every_replica_refusing_is_our_overload_error_with_a_fleet_retry_after():
    r = Replicas(["refuse", "refuse"], stats={"r0": {"num_waiting": 4, "drain_rate": 1.0},
                                              "r1": {"num_waiting": 4, "drain_rate": 1.0}})
    texts, err = asyncio.run(run(fleet(r)))
    assert texts == [] and isinstance(err, OverloadedError) and err.reason == "queue_full"
    assert err.retry_after == 4.0  # 8 waiting in the fleet over 2 starts/s


def test_all_replicas_full_is_refused_before_dispatch():
    f = fleet(Replicas([], stats={"r0": {"num_waiting": 2, "max_waiting_requests": 2},
                                  "r1": {"num_waiting": 2, "max_waiting_requests": 2}}))
    with pytest.raises(OverloadedError):
        f.reserve()


def test_death_before_the_first_output_is_retried_once_after_it_is_a_coded_error():
    r = Replicas(["die_before", "ok"])
    assert asyncio.run(run(fleet(r))) == (["t1", "t2"], None)
    assert r.calls[1][1] == ("r0",)
    texts, err = asyncio.run(run(fleet(Replicas(["die_before", "die_before"]))))
    assert texts == [] and isinstance(err, ReplicaLostError) and err.code == "replica_died"
    texts, err = asyncio.run(run(fleet(Replicas(["die_after"]))))  # a client saw part of it: never replayed
    assert texts == ["t1"] and isinstance(err, ReplicaLostError) and err.code == "replica_died"
