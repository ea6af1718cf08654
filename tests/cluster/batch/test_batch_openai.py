"""OpenAI batch files: lines read as the HTTP API reads requests, result bodies as the HTTP
API builds them, the processor's argument checks, and `python -m cluster.batch` (what
`./dev batch` runs) end to end in a subprocess on the shared Ray cluster (RAY_ADDRESS).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cluster.api.openai_responses import ChatBuilder, CompletionBuilder
from cluster.api.protocol import ChatCompletionRequest, CompletionRequest
from cluster.batch import ProcessorConfig
from cluster.batch.engine_stage import sampling_params
from cluster.batch.openai_batch import ModelFacts, read_request, response_body, write_result
from cluster.engine.config import EngineConfig
from scheduler.outputs import CompletionOutput, RequestOutput

ROOT = Path(__file__).resolve().parents[3]
ENGINE = dict(model="qwen3-tiny", max_model_len=128)


@pytest.fixture(scope="module")
def facts() -> ModelFacts:
    return ModelFacts.of(EngineConfig(**ENGINE))


def _line(custom_id: str, url: str, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_processor_config_names_what_to_change() -> None:
    with pytest.raises(ValueError, match=r"concurrency must be an integer >= 1 .*got \(3, 2\)"):
        ProcessorConfig(concurrency=(3, 2))
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1; got 0"):
        ProcessorConfig(batch_size=0)
    with pytest.raises(ValueError, match=r"unknown engine argument\(s\) \['tp'\]"):
        ProcessorConfig(engine_kwargs={"tp": 2})
    with pytest.raises(ValueError, match="engine_num_gpus must be >= 0 or None"):
        ProcessorConfig(engine_num_gpus=-1)
    assert ProcessorConfig(concurrency=[1, 3]).pool_size == (1, 3)
    # A tp-1 engine runs its model in the actor: the actor takes the GPU; a tp-2 engine's
    # workers take theirs in their own placement group.
    assert ProcessorConfig().engine_gpus(cluster_gpus=8) == 1.0
    assert ProcessorConfig().engine_gpus(cluster_gpus=0) == 0.0
    assert ProcessorConfig(engine_kwargs={"tensor_parallel_size": 2}).engine_gpus(8) == 0.0


def test_row_sampling_params_take_the_engine_defaults_for_what_they_leave_out() -> None:
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    sp = sampling_params({"temperature": 0.0, "top_p": None, "logit_bias": {"7": -100.0}},
                         defaults)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.logit_bias) == (0.0, 0.95, 20, {7: -100.0})
    sp = sampling_params(json.dumps({"structured_outputs": {"choice": ["a", "b"]}}), {})
    assert sp.structured_outputs.choice == ["a", "b"]
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['max_token'\]"):
        sampling_params({"max_token": 3}, {})


def test_bad_lines_get_errors_as_the_http_api_gives_them(facts: ModelFacts) -> None:
    def read(text: str) -> dict[str, Any]:
        return read_request({"text": text}, facts)

    assert "not a JSON request object" in read("{oops")["request_error"]
    assert read(_line("a", "/v1/moderations", {}))["request_error"] == (
        "url must be one of ['/v1/chat/completions', '/v1/completions', '/v1/embeddings', "
        "'/v1/score', '/v1/rerank']; got '/v1/moderations'")
    row = read(_line("b", "/v1/completions", {"prompt": "hi", "max_tokens": "ten"}))
    assert row["status_code"] == 400 and row["request_error"] is None
    assert json.loads(row["error_body"])["error"]["param"] == "max_tokens"
    row = read(_line("c", "/v1/chat/completions", {"messages": [{"role": "user",
                                                                 "content": "hi"}], "n": 2}))
    assert json.loads(row["error_body"])["error"]["message"] == (
        "n is not supported in a batch request (one whole completion per line); remove it")
    row = read(_line("d", "/v1/completions", {"prompt": "hi", "max_tokens": 500}))
    assert "maximum context length is 128 tokens" in row["error"]
    good = read(_line("e", "/v1/completions", {"prompt": "hi", "max_tokens": 3,
                                               "temperature": 0}))
    assert good["error"] is None and good["prompt_token_ids"] == [6023]
    params = sampling_params(good["sampling_params"], {})
    assert (params.max_tokens, params.temperature) == (3, 0.0)


@pytest.mark.parametrize("url", ["/v1/chat/completions", "/v1/completions"])
def test_result_body_is_the_http_api_body(url: str) -> None:
    """Against cluster/api's own builder fed the same engine output (ids and times aside)."""
    row = {"url": url, "request_id": "r1", "generated_text": "Hi there",
           "generated_tokens": [1, 2, 3], "num_input_tokens": 4, "num_generated_tokens": 3,
           "num_cached_tokens": 2, "finish_reason": "stop", "stop_reason": 151645,
           "custom_id": "x", "error": None}
    delta = RequestOutput("r1", [5, 6, 7, 8], [CompletionOutput(0, [1, 2, 3], "Hi there",
                                                                 "stop", 151645)], True, 2)
    if url == "/v1/chat/completions":
        req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
        builder: Any = ChatBuilder("qwen3-tiny", str, "chatcmpl-r1", req, [5, 6, 7, 8])
    else:
        req = CompletionRequest(prompt="hi")
        builder = CompletionBuilder("qwen3-tiny", str, "cmpl-r1", req, [[5, 6, 7, 8]], [""])
    builder.delta_chunk(0, delta, render=False)
    http, batch = builder.final(), response_body(row, "qwen3-tiny")
    assert {**batch, "created": 0} == {**http, "created": 0}
    result = json.loads(write_result(row, "qwen3-tiny")["line"])
    assert result["response"]["status_code"] == 200 and result["error"] is None
    assert result["response"]["request_id"] == batch["id"] == http["id"]


def test_cli_refuses_what_it_cannot_honour(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from cluster.batch.__main__ import main

    src = tmp_path / "in.jsonl"
    src.write_text("")
    assert main([str(src), str(tmp_path / "out"), "--reasoning-parser", "qwen3"]) == 2
    assert "reasoning_parser is not supported by batch jobs yet" in capsys.readouterr().err
    assert main([str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    assert "is not a file" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_runs_an_openai_batch_file(ray_cluster: None, tmp_path: Path) -> None:
    import ray

    from cluster.engine.llm import LLM
    from scheduler.sampling_params import SamplingParams

    prompts = [f"count {i} {'to ' * i}ten" for i in range(6)]
    lines = [_line(f"cmpl-{i}", "/v1/completions",
                   {"prompt": p, "max_tokens": 5, "temperature": 0, "ignore_eos": True})
             for i, p in enumerate(prompts)]
    lines += [_line("chat", "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4,
                     "temperature": 0, "ignore_eos": True}),
              "not json at all",
              _line("embed", "/v1/embeddings", {"input": "x"}),
              _line("too-long", "/v1/completions", {"prompt": "word " * 200})]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_ADDRESS":
           ray.get_runtime_context().gcs_address}
    proc = subprocess.run(
        [sys.executable, "-m", "cluster.batch", str(src), str(dst), "--model", "qwen3-tiny",
         "--max-model-len", "128", "--engine-num-cpus", "0.5", "--batch-size", "4"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "batch: 10 rows, 3 failed, 34 output tokens" in proc.stderr

    results = [json.loads(line) for line in dst.read_text().splitlines()]
    by_id = {r["custom_id"]: r for r in results}
    assert len(results) == 10 and len(by_id) == 10  # the bad JSON line's custom_id is None
    assert by_id[None]["response"] is None and "not a JSON" in by_id[None]["error"]["message"]
    embed = by_id["embed"]["response"]  # a generation model: the route's 400, as vLLM's
    assert embed["status_code"] == 400 and embed["body"]["error"]["param"] == "model"
    too_long = by_id["too-long"]["response"]
    assert too_long["status_code"] == 400
    assert "maximum context length is 128" in too_long["body"]["error"]["message"]
    with LLM(**ENGINE) as llm:
        want = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                            use_tqdm=False)
    for i, w in enumerate(want):
        body = by_id[f"cmpl-{i}"]["response"]["body"]
        assert body["choices"][0]["text"] == w.outputs[0].text
        assert body["usage"]["completion_tokens"] == 5
    chat = by_id["chat"]["response"]["body"]
    assert chat["object"] == "chat.completion" and chat["usage"]["completion_tokens"] == 4
