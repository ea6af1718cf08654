"""bench/serving.py's failure accounting: per HTTP status and per transport exception type,
from real `one_request` calls over an in-memory transport and from synthetic results."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import httpx

_PATH = Path(__file__).resolve().parents[3] / "bench" / "serving.py"
_spec = importlib.util.spec_from_file_location("bench_serving", _PATH)
serving = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = serving  # dataclasses look their module up while the class is built
_spec.loader.exec_module(serving)

TOKEN_CHUNK = 'data: {"choices":[{"index":0,"text":"a"}]}\n\n'
ERROR_CHUNK = 'data: {"error":{"message":"boom","type":"server_error"}}\n\n'
DONE = "data: [DONE]\n\n"


def _one(handler) -> serving.Result:
    async def go() -> serving.Result:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await serving.one_request(client, "http://bench", [1, 2, 3], 4)

    return asyncio.run(go())


def test_one_request_names_each_kind_of_failure() -> None:
    def timeout(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    def reset(request: httpx.Request) -> httpx.Response:
        raise httpx.RemoteProtocolError("peer closed connection", request=request)

    cases = {
        "http_503": lambda r: httpx.Response(503, json={"error": {"message": "busy"}}),
        "http_429": lambda r: httpx.Response(429, json={"error": {"message": "slow down"}}),
        "ReadTimeout": timeout,
        "RemoteProtocolError": reset,
        "sse_error": lambda r: httpx.Response(200, text=ERROR_CHUNK + DONE),
        "empty_stream": lambda r: httpx.Response(200, text=DONE),
    }
    for reason, handler in cases.items():
        res = _one(handler)
        assert (res.ok, res.error, res.output_tokens) == (False, reason, 0)
    assert _one(lambda r: httpx.Response(503)).status == 503


def test_one_request_that_streams_tokens_is_ok_without_error() -> None:
    res = _one(lambda r: httpx.Response(200, text=TOKEN_CHUNK * 3 + DONE))
    assert (res.ok, res.error, res.status, res.output_tokens, len(res.itls)) == (
        True, "", 200, 3, 2)


def test_breakdown_counts_per_reason_most_frequent_first() -> None:
    R = serving.Result
    results = [R(ok=True), R(ok=False, status=503, error="http_503"),
               R(ok=False, status=503, error="http_503"), R(ok=False, status=429, error="http_429"),
               R(ok=False, error="ReadTimeout"), R(ok=False, error="RemoteProtocolError"),
               R(ok=False, status=500)]  # no reason recorded: derived from the status
    failures = serving.failure_breakdown(results)
    assert list(failures.items()) == [("http_503", 2), ("ReadTimeout", 1),
                                      ("RemoteProtocolError", 1), ("http_429", 1),
                                      ("http_500", 1)]
    assert serving.format_failures(failures) == (
        "http_503=2 ReadTimeout=1 RemoteProtocolError=1 http_429=1 http_500=1")
    assert serving.format_failures({}) == "-"


def test_summary_row_carries_the_breakdown_into_json() -> None:
    R = serving.Result
    results = [R(ok=True, ttft=0.5, e2e=1.0, output_tokens=4),
               R(ok=False, status=503, error="http_503"), R(ok=False, error="ConnectError")]
    row = json.loads(json.dumps(serving.summarize("random", 2.0, results, wall=2.0)))
    assert (row["sent"], row["completed"], row["failed"]) == (3, 1, 2)
    assert row["failures"] == {"ConnectError": 1, "http_503": 1}
    assert row["output_tok_per_s"] == 2.0


def test_json_schema_workload_is_random_with_a_constraint_the_server_takes() -> None:
    from cluster.api.protocol import CompletionRequest
    from cluster.engine.grammar import check_schema

    reqs = serving.make_requests("json-schema", 5, seed=serving.WORKLOAD_SEEDS["json-schema"])
    assert reqs == serving.make_requests("random", 5, seed=serving.WORKLOAD_SEEDS["random"])
    assert serving.workload_body("random") == {}
    body = {"prompt": reqs[0][0], "max_tokens": reqs[0][1],
            **serving.workload_body("json-schema")}
    sp = CompletionRequest.model_validate_json(json.dumps(body)).to_sampling_params(4)
    assert sp.structured_outputs.json == serving.JSON_SCHEMA
    check_schema(serving.JSON_SCHEMA)  # nothing in it that xgrammar would not enforce
