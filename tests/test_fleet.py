"""The replica fleet without Ray: the Fleet's refusals, retries and coded errors over fake replicas (the Ray tier,
tests/test_ray.py, runs the real thing; the affinity policy is tests/test_affinity.py's)."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.engine.async_engine import AdmissionLimits, OverloadedError
from pagedserve.engine.input_processor import EngineRequest
from pagedserve.engine.output_processor import RequestMetrics, RequestOutput
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.server.affinity import RoutingKey
from pagedserve.server.fleet import Admitted, Fleet, Refused, ReplicaLostError, Scheduled
from pagedserve.server.serving import Built, Serving


# ---- Fleet over fake replicas --------------------------------------------------------------------------------
class Inputs:
    tokenizer = None
    max_model_len = 128


def request(rid: str, params: SamplingParams) -> EngineRequest:
    return EngineRequest(rid, [1, 2, 3], params, params.max_tokens)


def out(rid: str, token: int, finished: bool) -> RequestOutput:
    return RequestOutput(request_id=rid, new_token_ids=[token], text=f"t{token}", finished=finished,
                         finish_reason="length" if finished else None, num_prompt_tokens=3, num_output_tokens=token,
                         num_cached_tokens=0, metrics=RequestMetrics(0.0))


class Replicas:
    """Each call takes the next scripted behaviour: 'refuse', 'die_before', 'die_after', 'ok', or 'long_prefill'
    (scheduled, then its first output only once `prefilled` is set)."""

    def __init__(self, script: list[str], stats: dict | None = None) -> None:
        self.script, self.calls, self.ids, self.params = list(script), [], [], []
        self.stats = stats if stats is not None else {"r0": {}, "r1": {}}
        self.prefilled = asyncio.Event()

    async def dispatch(self, rid, ids, params, key: RoutingKey):
        what = self.script.pop(0)
        replica = f"r{len(self.calls) % 2}"
        self.calls.append((what, key.avoid))
        self.ids.append(rid)
        self.params.append(params)
        if what == "refuse":
            yield Refused(replica, "server overloaded: full", "queue_full")
            return
        yield Admitted(replica)
        if what == "die_before":
            raise ReplicaLostError("gone")
        if what == "long_prefill":
            yield Scheduled(replica)
            await self.prefilled.wait()
        yield out(rid, 1, False)
        if what == "die_after":
            raise ReplicaLostError("gone")
        yield out(rid, 2, True)


def fleet(replicas: Replicas) -> Fleet:
    return Fleet(Inputs(), replicas.dispatch, lambda: replicas.stats, AdmissionLimits(), 16)


async def run(f: Fleet) -> tuple[list[str], BaseException | None]:
    s = f.submit(request("req", SamplingParams(max_tokens=2)), f.reserve())
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


def test_the_request_id_is_the_replicas_and_a_live_one_is_suffixed():
    """The pipeline's engine ids (`<X-Request-Id>-<i>`) are what each replica is asked to run, on a retry too; one
    still live at the ingress (the same X-Request-Id twice at once) goes out suffixed, never clashing in a replica."""
    r = Replicas(["refuse", "ok", "ok", "ok", "ok"])

    async def main():
        f = fleet(r)
        params = SamplingParams(max_tokens=2)
        built = Built([request(f"client-7-{i}", params) for i in range(2)], 3)
        first = Serving(lambda: f, "m", False, 0.1).submit(f, built, f.reserve(2))
        assert f.num_waiting == 0  # each seat went with its request
        twin = f.submit(request("client-7-0", params), f.reserve())  # while the first is live
        streams = [*first, twin]
        assert [s.request_id for s in streams] == ["client-7-0", "client-7-1", "client-7-0#2"]
        for s in streams:
            await s.wait_started()
            assert [o.text async for o in s] == ["t1", "t2"]
        await asyncio.sleep(0)  # the remote calls' ends reach the fleet
        again = f.submit(request("client-7-0", params), f.reserve())
        assert again.request_id == "client-7-0"  # free again
        await again.wait_started()
        again.close()

    asyncio.run(main())
    # the refused first call is retried elsewhere under the same id
    assert r.ids == ["client-7-0", "client-7-0", "client-7-1", "client-7-0#2", "client-7-0"]


def test_scheduled_reaches_the_stream_before_the_first_output_and_priority_reaches_the_replica():
    """What the pipeline's --max-queue-wait-s reads: a replica's Scheduled marks the request started while its
    prefill runs; and the request's params, priority included, arrive at the replica as sent."""
    r = Replicas(["long_prefill"])

    async def scenario():
        f = fleet(r)
        s = f.submit(request("req", SamplingParams(max_tokens=2, priority=-3)), f.reserve())
        while not s.scheduled:
            await asyncio.sleep(0)
        assert not s._first.is_set()  # scheduled, no output yet
        r.prefilled.set()
        await s.wait_started()
        return [o.text async for o in s]

    assert asyncio.run(scenario()) == ["t1", "t2"]
    assert r.params[0].priority == -3


def test_retry_after_before_any_drain_rate_is_the_soonest_replica_estimate():
    r = Replicas(["refuse", "refuse"], stats={"r0": {"num_waiting": 4, "estimated_wait": 7.2},
                                              "r1": {"num_waiting": 1, "estimated_wait": 2.1}})
    texts, err = asyncio.run(run(fleet(r)))
    assert isinstance(err, OverloadedError) and err.retry_after == 3.0  # a retry may go to r1: ceil(2.1)
    assert fleet(Replicas([], stats={"r0": {}})).retry_after() == 1.0  # nothing published yet: the floor
