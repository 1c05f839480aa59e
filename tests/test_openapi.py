"""The OpenAPI document tells the truth: a schema-driven fuzzer (schemathesis) sends what the document allows, and
the server never answers 5xx nor with a status code the document does not list. The docs are served offline."""

from __future__ import annotations

import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import status_code_conformance
from test_server import running_server

from pagedserve.engine import LLMEngine, make_config


@pytest.fixture(scope="module")
def fuzz_server(tiny_hf_dir):
    """A tiny random model behind the bundled tokenizer: every generated request is cheap to serve."""
    engine = LLMEngine(make_config(model=str(tiny_hf_dir), dtype="float32", device="cpu", num_blocks=256))
    with running_server(engine) as (base, state):
        yield base, state


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    base, _ = fuzz_server
    return schemathesis.openapi.from_url(f"{base}/openapi.json")


@pytest.mark.slow  # load, flood or fuzz: the heavy tier
def test_fuzzed_requests_get_documented_answers(api_schema):
    """Every operation, with what the document allows (and what it does not): no 5xx, no undocumented status."""
    seen: dict[str, set[int]] = {}
    examples = int(os.environ.get("FUZZ_EXAMPLES", 30))  # more, to search harder by hand
    def fuzz(operation) -> None:
        codes = seen.setdefault(operation.label, set())

        @given(case=operation.as_strategy())
        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case):
            response = case.call_and_validate(checks=[not_a_server_error, status_code_conformance], timeout=120)
            codes.add(response.status_code)

        check()

    for result in api_schema.get_all_operations():
        fuzz(result.ok())
    assert seen["POST /v1/chat/completions"] >= {200, 400} and seen["POST /v1/completions"] >= {200, 400}


def test_the_document_and_docs_work_offline(fuzz_server):
    base, state = fuzz_server
    doc = httpx.get(f"{base}/openapi.json").json()
    chat = doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert "422" not in chat and {"400", "429", "503"} <= set(chat)
    assert "Retry-After" in chat["429"]["headers"]
    metrics = doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    page = httpx.get(f"{base}/docs").text
    assert "/docs/assets/swagger-ui-bundle.js" in page and "cdn" not in page.lower()
    assert httpx.get(f"{base}/docs/assets/swagger-ui-bundle.js").status_code == 200
    assert state.engine.engine.block_manager.num_used_blocks == 0 or state.engine.num_running
