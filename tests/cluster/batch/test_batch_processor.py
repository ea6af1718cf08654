"""cluster.batch's processor on the shared Ray cluster: a few hundred rows through an engine
actor pool give LLM.generate's greedy tokens, bad rows carry their error and cost only
themselves, and an engine actor SIGKILLed mid-job has its batches run again: every row
comes out exactly once, right. One job shows all three (each engine start costs seconds here).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import pytest
from engine_kill import consume_killing_one_engine

from cluster.batch import ProcessorConfig, build_processor
from cluster.engine.llm import LLM
from scheduler.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

ENGINE = dict(model="qwen3-tiny", max_model_len=128)
WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "ember"]


def _rows(n: int, max_tokens: int) -> list[dict[str, Any]]:
    """n rows: every third a chat, the rest prompts; a few lengths of output."""
    rows = []
    for i in range(n):
        text = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(1 + i % 5)) + f" {i}"
        sp = {"temperature": 0.0, "max_tokens": max_tokens - i % 3, "ignore_eos": True}
        row: dict[str, Any] = {"id": i, "sampling_params": sp}
        if i % 3 == 0:
            row["messages"] = [{"role": "user", "content": text}]
        else:
            row["prompt"] = text
        rows.append(row)
    return rows


def _expected(rows: list[dict[str, Any]]) -> dict[int, list[int]]:
    """LLM.generate's tokens for each row (chats rendered as LLM.chat renders them)."""
    with LLM(**ENGINE) as llm:
        tok = llm.get_tokenizer()
        prompts = [r["prompt"] if "prompt" in r else tok.apply_chat_template(
            r["messages"], tokenize=False, add_generation_prompt=True) for r in rows]
        params = [SamplingParams(**r["sampling_params"]) for r in rows]
        outs = llm.generate(prompts, params, use_tqdm=False)
    return {r["id"]: o.outputs[0].token_ids for r, o in zip(rows, outs)}


BAD = [
    {"id": 1000, "prompt": "too long " * 100, "sampling_params": {"max_tokens": 4}},
    {"id": 1001, "prompt": "hi", "sampling_params": {"top_p": 7.0}},
    {"id": 1002, "prompt": "hi", "sampling_params": {"temprature": 0.5}},
    {"id": 1003, "prompt": "hi", "sampling_params": {"n": 2}},
    {"id": 1004, "sampling_params": {"max_tokens": 4}},
]


@dataclass
class Job:
    rows: list[dict[str, Any]]
    out: list[dict[str, Any]]
    expected: dict[int, list[int]]
    done_before_kill: int


@pytest.fixture(scope="module")
def job(ray_cluster: None) -> Job:
    """240 good rows with the bad ones among them, through one engine actor that is
    SIGKILLed once its first batch is out; and LLM.generate's tokens for the good rows."""
    import ray.data

    good = _rows(240, max_tokens=6)
    rows = good[:120] + BAD + good[120:]
    processor = build_processor(
        ProcessorConfig(engine_kwargs=ENGINE, engine_num_cpus=0.5, batch_size=8,
                        max_batches_in_flight=3),
        preprocess=lambda row: {**row, "seen_by_preprocess": True},
        postprocess=lambda row: {**row, "text_len": len(row["generated_text"] or "")})
    ds = processor(ray.data.from_items(rows, override_num_blocks=4))
    out, done_before_kill = consume_killing_one_engine(ds)
    return Job(rows, out, _expected(good), done_before_kill)


def test_every_row_comes_out_exactly_once_after_an_engine_actor_is_killed(job: Job) -> None:
    assert 0 < job.done_before_kill < len(job.rows)
    assert sorted(r["id"] for r in job.out) == sorted(r["id"] for r in job.rows)


def test_rows_match_llm_generate(job: Job) -> None:
    by_id = {r["id"]: r for r in job.out}
    for i, tokens in job.expected.items():
        row = by_id[i]
        assert row["error"] is None, row["error"]
        assert row["generated_tokens"] == tokens, i
        assert row["num_generated_tokens"] == len(tokens)
        assert row["finish_reason"] == "length"
        assert row["seen_by_preprocess"] and row["text_len"] == len(row["generated_text"])


def test_bad_rows_carry_their_error_and_no_output(job: Job) -> None:
    by_id = {r["id"]: r for r in job.out}
    errors = {b["id"]: by_id[b["id"]]["error"] for b in BAD}
    assert "max_model_len is 128" in errors[1000]
    assert errors[1001] == "top_p must be (0, 1]; got 7.0"
    assert "unknown field(s) ['temprature']" in errors[1002]
    assert "sampling_params.n is 2" in errors[1003]
    assert "a row needs `messages`" in errors[1004]
    for i in errors:
        assert by_id[i]["generated_tokens"] is None and by_id[i]["generated_text"] is None


def test_tensor_parallel_engines_give_the_same_tokens(job: Job) -> None:
    """tp 2: each engine actor starts its own two Ray workers in their own placement group."""
    import ray.data

    rows = [r for r in job.rows if r["id"] in job.expected][:24]
    config = ProcessorConfig(engine_kwargs=dict(ENGINE, tensor_parallel_size=2,
                                                worker_num_cpus=0.5),
                             engine_num_cpus=0.25, batch_size=8)
    out = build_processor(config)(ray.data.from_items(rows)).take_all()
    assert sorted(r["id"] for r in out) == [r["id"] for r in rows]
    for row in out:
        assert row["error"] is None and row["generated_tokens"] == job.expected[row["id"]]


def test_engine_that_cannot_serve_fails_the_job_instead_of_hanging(ray_cluster: None) -> None:
    """ray#59986: Ray Data LLM waits forever on a dead engine. Here the actor exits (its
    engine "stalls" at once: engine_stall_timeout_s of a microsecond), Ray restarts it
    max_restarts times, and then the job fails with the actor's death."""
    import ray.data
    import ray.exceptions

    config = ProcessorConfig(engine_kwargs=dict(ENGINE, engine_stall_timeout_s=1e-6),
                             engine_num_cpus=0.5, batch_size=4, max_restarts=1)
    rows = [{"prompt": f"row {i}", "sampling_params": {"max_tokens": 64, "ignore_eos": True}}
            for i in range(8)]
    start = time.monotonic()
    with pytest.raises(ray.exceptions.ActorDiedError, match="EngineStage") as raised:
        build_processor(config)(ray.data.from_items(rows)).take_all()
    assert time.monotonic() - start < 180, raised.value
