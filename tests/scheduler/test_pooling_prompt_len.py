"""A pooling request (PoolingSamplingParams: max_tokens 1, a placeholder output that is never
computed) may hold max_model_len prompt tokens, as vLLM allows for pooling; a generation
request's prompt must leave room for one output token. Both the engine's check
(`check_prompt_fits`) and the scheduler's (`add_request`) follow that one rule, and a pooling
request of max_model_len tokens runs through chunked prefill to its finish without a KV slot
beyond max_model_len."""

from __future__ import annotations

import pytest
from scheduler_harness import make, run_to_completion

from scheduler import SamplingParams
from scheduler.request import check_prompt_fits
from scheduler.sampling_params import PoolingSamplingParams

POOL = PoolingSamplingParams(max_tokens=1, temperature=0.0)


def test_pooling_prompt_may_fill_max_model_len_and_a_generation_prompt_may_not() -> None:
    assert POOL.max_prompt_len(64) == 64 and SamplingParams().max_prompt_len(64) == 63
    check_prompt_fits(64, POOL, 64)
    with pytest.raises(ValueError, match="the input has 65 tokens; max_model_len is 64"):
        check_prompt_fits(65, POOL, 64)
    with pytest.raises(ValueError, match="at least one token must be generated"):
        check_prompt_fits(64, SamplingParams(max_tokens=1), 64)
    check_prompt_fits(63, SamplingParams(max_tokens=1), 64)
    with pytest.raises(ValueError, match=r"\(60 tokens\) \+ max_tokens \(5\) = 65 exceeds"):
        check_prompt_fits(60, SamplingParams(max_tokens=5), 64)


def test_scheduler_runs_a_pooling_prompt_of_max_model_len_in_chunks() -> None:
    # 8 blocks of 4: exactly the prompt's, so a slot beyond max_model_len could not be had
    sched, kv, worker = make(num_gpu_blocks=8, block_size=4, max_model_len=32,
                             max_num_batched_tokens=8, max_num_seqs=2)
    prompt = list(range(100, 132))
    with pytest.raises(ValueError, match="prompt has 32 tokens; max_model_len is 32"):
        sched.add_request("gen", prompt, SamplingParams(max_tokens=1))
    sched.add_request("pool", prompt, POOL)
    got = run_to_completion(sched, kv, worker)
    out = got[("pool", 0)]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    assert kv.num_free_gpu_blocks == 8
    with pytest.raises(ValueError, match="prompt has 33 tokens; max_model_len is 32"):
        sched.add_request("pool2", prompt + [7], POOL)
