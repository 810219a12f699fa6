"""schemathesis against the server's own OpenAPI description (/openapi.json): bodies that follow each
operation's schema and bodies that break it, sent to a tiny random model's server. No answer is a 5xx, no body
breaking the schema is accepted, and every 4xx carries the API's error body. Seeded and short here (CI);
benchmarks/fuzz_server.py runs longer."""

import json
import os
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from mlx_lm_reference import save_hf_model
from servers import Served

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.checks import negative_data_rejection, not_a_server_error  # noqa: E402

pytestmark = pytest.mark.slow  # a `minimlx serve` process

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", 40))  # per operation and phase; benchmarks/fuzz_server.py sets more
SENT: Counter = Counter()  # examples sent per operation, printed at the end (pytest -s)


@pytest.fixture(scope="module")
def fuzzed_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_hf_model(folder, "llama")
    server = Served("--model", str(folder), "--max-batch", "4", "--request-timeout", "10")
    yield server
    server.stop()
    print("examples sent:", dict(SENT))


@pytest.fixture(scope="module")
def api_schema(fuzzed_server):
    return schemathesis.openapi.from_url(f"{fuzzed_server.url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


def check_answer(case, response) -> None:
    """No 5xx; a body that breaks the schema refused (no field of the wrong type ignored); a 4xx in the error
    shape of the API asked (Anthropic's under /v1/messages)."""
    SENT[case.operation.label] += 1
    case.validate_response(response, checks=[not_a_server_error, negative_data_rejection])
    assert response.status_code < 500, (case.body, response.text)
    if response.status_code >= 400:
        body = json.loads(response.text)
        if case.path.startswith("/v1/messages"):
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        else:
            assert set(body["error"]) == {"message", "type", "param", "code"}, body


@schema.parametrize()
@settings(max_examples=EXAMPLES, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_request_gets_a_server_error_and_every_refusal_its_error_body(case):
    check_answer(case, case.call(timeout=30))
