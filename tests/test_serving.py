"""The request pipeline (server/serving.py) over a fake EngineClient, without a model: what it reserves, builds,
submits and gives back, its 400 / 429 paths, what a refusal halfway aborts, and that a grammar is compiled in the
worker thread that builds a request, never on the event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping

import pytest

from pagedserve.engine.async_engine import AdmissionLimits, OverloadedError
from pagedserve.engine.client import EngineClient, NoEngineViewError, QueuePlaces, Reservation
from pagedserve.engine.config import bundled_model_path
from pagedserve.engine.input_processor import EngineRequest, InputProcessor
from pagedserve.engine.llm_engine import EngineStats
from pagedserve.engine.output_processor import RequestMetrics, RequestOutput
from pagedserve.engine.structured import StructuredOutputs
from pagedserve.engine.tokenizer import load_tokenizer
from pagedserve.server.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.server.serving import APIError, ChatEndpoint, CompletionEndpoint, Serving


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(bundled_model_path())


class Stream:
    """Two outputs, then finished; `close()` before that is an abort."""

    def __init__(self, client: FakeClient, request: EngineRequest) -> None:
        self.client, self.request_id, self.finished = client, request.request_id, False
        self.scheduled = True
        self._outs = [self._out(1, False), self._out(2, True)]

    def _out(self, token: int, finished: bool) -> RequestOutput:
        return RequestOutput(self.request_id, [token], f"t{token}", finished, "length" if finished else None, 3, token,
                             0, RequestMetrics(0.0))

    async def wait_started(self) -> None:
        pass

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._outs:
            raise StopAsyncIteration
        out = self._outs.pop(0)
        self.finished = out.finished
        return out

    def close(self) -> None:
        self.client.live.discard(self.request_id)
        if not self.finished:
            self.client.aborted.append(self.request_id)


class FakeClient(EngineClient):
    """An EngineClient that runs nothing: it records what it was handed and answers with scripted outputs."""

    def __init__(self, inputs: InputProcessor, limits: AdmissionLimits | None = None, full: bool = False,
                 refuse: int | None = None) -> None:
        self.input_processor, self.limits = inputs, limits or AdmissionLimits(max_waiting_requests=8)
        self.full, self.refuse = full, refuse  # refuse: the submit call (0-based) that is overloaded
        self.places = QueuePlaces()
        self.submitted: list[EngineRequest] = []
        self.live: set[str] = set()
        self.aborted: list[str] = []

    alive = True

    @property
    def num_waiting(self) -> int:
        return self.places.reserved

    @property
    def in_flight(self) -> int:
        return len(self.live) + self.places.reserved

    def reserve(self, count: int = 1) -> Reservation:
        if self.full:
            raise OverloadedError("server overloaded: full", 2.5)
        return self.places.hold(count)

    def submit(self, request: EngineRequest, places: Reservation, tenant: str | None = None) -> Stream:
        places.take()
        if self.refuse == len(self.submitted):
            raise OverloadedError("server overloaded: too many prompt tokens", 1.0)
        self.submitted.append(request)
        self.live.add(request.request_id)
        return Stream(self, request)

    def expected_wait(self) -> float | None:
        return None

    def estimated_wait(self, ahead: int | None = None) -> float | None:
        return None

    def stats(self) -> EngineStats | Mapping[str, EngineStats]:
        return EngineStats(0, self.num_waiting, 0.0, 0, 0, 0, None)

    async def snapshot(self, timeout: float):
        raise NoEngineViewError

    def tenant_of(self, request_id: str) -> str | None:
        return None

    def fail_all(self, error: BaseException) -> None:
        pass

    def shutdown(self) -> None:
        pass


class Raw:
    """What the pipeline reads of a Starlette request."""

    def __init__(self, request_id: str = "client-1") -> None:
        from pagedserve.server.tracing import REQUEST_KEY, RequestRecord

        self.scope = {"state": {REQUEST_KEY: RequestRecord(request_id, "POST", "/v1/completions")}}

    async def is_disconnected(self) -> bool:
        return False


def inputs(tokenizer=None, max_model_len: int = 64) -> InputProcessor:
    return InputProcessor(tokenizer, 100 if tokenizer is None else len(tokenizer), max_model_len)


def generate(client: FakeClient, endpoint, body):
    return asyncio.run(Serving(lambda: client, "m", False, 0.05).generate(endpoint, body, Raw()))


def test_each_choice_is_one_request_built_once_with_one_seat():
    client = FakeClient(inputs())
    r = generate(client, CompletionEndpoint, CompletionRequest(prompt=[[1, 2, 3], [4, 5]], max_tokens=2, n=2))
    assert [x.request_id for x in client.submitted] == ["client-1-0", "client-1-1", "client-1-2", "client-1-3"]
    assert [x.prompt_token_ids for x in client.submitted] == [[1, 2, 3]] * 2 + [[4, 5]] * 2
    assert all(x.max_tokens == 2 for x in client.submitted)
    assert [c.text for c in r.choices] == ["t1t2"] * 4 and r.usage.prompt_tokens == 5
    assert client.places.reserved == 0 and client.aborted == [] and not client.live


def test_unasked_max_tokens_is_resolved_in_the_record():
    client = FakeClient(inputs(max_model_len=64))
    generate(client, CompletionEndpoint, CompletionRequest(prompt=[1, 2, 3], max_tokens=None))
    assert client.submitted[0].max_tokens == 16  # the completions default, checked against the context


def test_overload_is_a_429_before_anything_is_built():
    built = []
    proc = inputs()
    real = proc.process
    proc.process = lambda *a, **k: built.append(a) or real(*a, **k)
    client = FakeClient(proc, full=True)
    with pytest.raises(APIError) as e:
        generate(client, CompletionEndpoint, CompletionRequest(prompt=[1, 2, 3], max_tokens=2))
    assert e.value.status == 429 and e.value.headers["Retry-After"] == "3" and e.value.reason == "queue_full"
    assert built == [] and client.submitted == []


def test_a_request_that_cannot_fit_is_a_400_and_its_places_go_back():
    client = FakeClient(inputs(max_model_len=8))
    with pytest.raises(APIError) as e:
        generate(client, CompletionEndpoint, CompletionRequest(prompt=[1, 2, 3], max_tokens=6, n=2))
    assert e.value.status == 400 and e.value.body["error"]["code"] == "context_length_exceeded"
    assert e.value.body["error"]["param"] == "prompt"
    assert client.submitted == [] and client.places.reserved == 0


def test_more_sequences_than_may_wait_is_a_400_naming_n():
    client = FakeClient(inputs(), AdmissionLimits(max_waiting_requests=2))
    with pytest.raises(APIError) as e:
        generate(client, CompletionEndpoint, CompletionRequest(prompt=[1, 2, 3], max_tokens=2, n=3))
    assert e.value.status == 400 and e.value.body["error"]["param"] == "n" and client.places.reserved == 0


def test_a_prompt_longer_than_may_queue_is_a_400():
    client = FakeClient(inputs(), AdmissionLimits(max_queued_tokens=2))
    with pytest.raises(APIError) as e:
        generate(client, CompletionEndpoint, CompletionRequest(prompt=[1, 2, 3], max_tokens=2))
    assert e.value.status == 400 and "--max-queued-tokens" in e.value.body["error"]["message"]
    assert client.submitted == [] and client.places.reserved == 0


def test_a_refusal_halfway_aborts_what_was_submitted_and_returns_every_seat():
    client = FakeClient(inputs(), refuse=1)
    with pytest.raises(APIError) as e:
        generate(client, CompletionEndpoint, CompletionRequest(prompt=[1, 2, 3], max_tokens=2, n=3))
    assert e.value.status == 429
    assert [x.request_id for x in client.submitted] == ["client-1-0"] and client.aborted == ["client-1-0"]
    assert client.places.reserved == 0 and not client.live


def test_unknown_model_is_a_404_before_any_seat():
    client = FakeClient(inputs(), full=True)
    with pytest.raises(APIError) as e:
        generate(client, CompletionEndpoint, CompletionRequest(model="gpt-9", prompt=[1, 2, 3], max_tokens=2))
    assert e.value.status == 404


def test_the_grammar_is_compiled_in_the_building_thread_not_on_the_event_loop(tokenizer, monkeypatch):
    threads: list[int] = []
    real = StructuredOutputs.constraint_for

    def constraint_for(self, params):
        threads.append(threading.get_ident())
        return real(self, params)

    monkeypatch.setattr(StructuredOutputs, "constraint_for", constraint_for)
    client = FakeClient(inputs(tokenizer, max_model_len=256))
    loop_thread: list[int] = []

    async def main():
        loop_thread.append(threading.get_ident())
        body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2,
                                     response_format={"type": "json_object"})
        return await Serving(lambda: client, "m", False, 0.05).generate(ChatEndpoint, body, Raw())

    asyncio.run(main())
    assert len(threads) == 2 and loop_thread[0] not in threads  # one constraint per choice, both off the loop
    matchers = [x.constraint.matcher for x in client.submitted]
    assert all(m is not None for m in matchers) and matchers[0] is not matchers[1]  # each choice its own
