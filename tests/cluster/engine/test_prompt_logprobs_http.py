"""/v1/completions with `echo` and `logprobs` (what lm-evaluation-harness's loglikelihood
requests send) and vLLM's `prompt_logprobs`, over the in-process app on a real engine whose
24-token budget chunks every prompt: the prompt's tokens in OpenAI's legacy logprobs format
(null first) before the completion's, against transformers' log-softmax (2e-3)."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch

from cluster.api.engine_client import LocalEngineClient
from cluster.api.openai_api import create_app
from cluster.engine.async_llm_engine import AsyncLLMEngine
from cluster.engine.config import EngineConfig

ATOL = 2e-3
TEXTS = ["Question: What is the capital of France?\nAnswer: Paris is the capital, and it sits "
         "on the Seine river in the north of the country.",
         "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints five on the console"]


@pytest.fixture(scope="module")
def engine() -> Any:
    engine = AsyncLLMEngine(EngineConfig(model="qwen3-tiny", max_num_seqs=8,
                                         max_num_batched_tokens=24))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf(tiny_model_path: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)


def oracle(hf: Any, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)


def post(engine: AsyncLLMEngine, *bodies: dict) -> list[httpx.Response]:
    """The bodies, one after the other, to one app."""
    app = create_app(LocalEngineClient(engine), engine.tokenizer)

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as http:
            return [await http.post("/v1/completions", content=json.dumps(b)) for b in bodies]

    return asyncio.run(go())


def check_echo(hf: Any, tok: Any, prompt: list[int], lp: dict[str, Any], k: int,
               generated: int) -> None:
    """The legacy logprobs of an echoed prompt followed by `generated` tokens."""
    texts = [tok.decode([t]) for t in prompt]
    n = len(prompt)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) \
        == len(lp["text_offset"]) == n + generated
    assert lp["tokens"][:n] == texts
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = oracle(hf, prompt)
    for j in range(1, n):
        assert abs(lp["token_logprobs"][j] - ref[j - 1, prompt[j]].item()) <= ATOL
        top = lp["top_logprobs"][j]
        assert len(top) <= k
        want = ref[j - 1].topk(k).values.tolist()
        assert sorted(top.values(), reverse=True) == pytest.approx(want[:len(top)], abs=ATOL)
    offsets = [0]
    for t in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp["text_offset"] == offsets
    assert all(v is not None for v in lp["token_logprobs"][n:])


def test_echo_with_logprobs_for_text_and_token_prompts(engine: AsyncLLMEngine, hf: Any) -> None:
    tok = engine.tokenizer
    rng = random.Random(5)
    id_prompts = [[rng.randrange(100, 150000) for _ in range(k)] for k in (30, 45)]
    texts, ids, single = post(
        engine,
        {"prompt": TEXTS, "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0},
        {"prompt": id_prompts, "max_tokens": 2, "echo": True, "logprobs": 3, "temperature": 0},
        {"prompt": TEXTS[0], "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0})
    for resp in (texts, ids, single):
        assert resp.status_code == 200, resp.text
    for text, choice in zip(TEXTS, texts.json()["choices"]):
        prompt = tok.encode(text, add_special_tokens=False)
        assert choice["text"].startswith(text) and len(prompt) > 24
        check_echo(hf, tok, prompt, choice["logprobs"], 1, 1)
    for prompt, choice in zip(id_prompts, ids.json()["choices"]):
        assert choice["text"].startswith(tok.decode(prompt))
        check_echo(hf, tok, prompt, choice["logprobs"], 3, 2)
    # the same prompt again (its blocks are in the prefix cache, which a request for prompt
    # logprobs does not use): the same tokens and values, up to fp32 rounding (the steps batch
    # it with other rows than the first time, and a GEMM of other M may round otherwise)
    again, first = single.json()["choices"][0]["logprobs"], texts.json()["choices"][0]["logprobs"]
    assert again["tokens"] == first["tokens"] and again["text_offset"] == first["text_offset"]
    assert [None if t is None else list(t) for t in again["top_logprobs"]] == \
        [None if t is None else list(t) for t in first["top_logprobs"]]
    assert again["token_logprobs"][0] is first["token_logprobs"][0] is None
    assert np.allclose(again["token_logprobs"][1:], first["token_logprobs"][1:], rtol=0, atol=1e-5)
    assert single.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_echo_with_max_tokens_0_returns_the_prompt_alone(engine: AsyncLLMEngine,
                                                         hf: Any) -> None:
    tok = engine.tokenizer
    prompt = tok.encode(TEXTS[1], add_special_tokens=False)
    (resp,) = post(engine, {"prompt": TEXTS[1], "max_tokens": 0, "echo": True, "logprobs": 2})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    choice = body["choices"][0]
    assert choice["text"] == TEXTS[1]
    check_echo(hf, tok, prompt, choice["logprobs"], 2, 0)
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["prompt_tokens"] == len(prompt)


def test_streamed_echo_sends_the_prompt_part_in_the_first_chunk(engine: AsyncLLMEngine,
                                                                hf: Any) -> None:
    tok = engine.tokenizer
    prompt = tok.encode(TEXTS[0], add_special_tokens=False)
    body = {"prompt": TEXTS[0], "max_tokens": 3, "echo": True, "logprobs": 2,
            "temperature": 0, "stream": True}
    (resp,) = post(engine, body)
    assert resp.status_code == 200
    events = [json.loads(line[6:]) for line in resp.text.splitlines()
              if line.startswith("data: {")]
    parts = [e["choices"][0] for e in events]
    assert parts[0]["text"].startswith(TEXTS[0])
    assert len(parts[0]["logprobs"]["tokens"]) == len(prompt) + 1
    joined: dict[str, list] = {key: [] for key in parts[0]["logprobs"]}
    for p in parts:
        for key, values in p["logprobs"].items():
            joined[key] += values
    check_echo(hf, tok, prompt, joined, 2, 3)
    whole = post(engine, {**body, "stream": False})[0].json()["choices"][0]
    assert whole["logprobs"] == joined
    assert whole["text"] == "".join(p["text"] for p in parts)


def test_vllm_prompt_logprobs_field_without_echo(engine: AsyncLLMEngine, hf: Any) -> None:
    tok = engine.tokenizer
    prompt = tok.encode(TEXTS[0], add_special_tokens=False)
    (resp,) = post(engine, {"prompt": TEXTS[0], "max_tokens": 2, "prompt_logprobs": 2,
                            "n": 2, "temperature": 0.5, "seed": 3})
    assert resp.status_code == 200, resp.text
    ref = oracle(hf, prompt)
    for choice in resp.json()["choices"]:
        got = choice["prompt_logprobs"]
        assert got[0] is None and len(got) == len(prompt) and choice["logprobs"] is None
        for j in range(1, len(prompt)):
            entry = got[j][str(prompt[j])]
            assert abs(entry["logprob"] - ref[j - 1, prompt[j]].item()) <= ATOL
            assert entry["decoded_token"] == tok.decode([prompt[j]])
            # the prompt token and the top 2 (which may include it)
            assert sorted(e["rank"] for e in got[j].values() if e["rank"] <= 2) == [1, 2]
            assert len(got[j]) in (2, 3)


def test_the_openai_client_reads_echoed_logprobs(engine: AsyncLLMEngine, hf: Any) -> None:
    app = create_app(LocalEngineClient(engine), engine.tokenizer)

    async def go() -> Any:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http)
        try:
            return await client.completions.create(model=engine.model_name, prompt=TEXTS[1],
                                                   max_tokens=1, echo=True, logprobs=1,
                                                   temperature=0)
        finally:
            await http.aclose()

    lp = asyncio.run(go()).choices[0].logprobs
    prompt = engine.tokenizer.encode(TEXTS[1], add_special_tokens=False)
    check_echo(hf, engine.tokenizer, prompt, lp.model_dump(), 1, 1)
