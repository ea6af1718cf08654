"""Validation of user input, the state machine, stats, and text through a whole fake run."""

from __future__ import annotations

import numpy as np
import pytest
from scheduler_harness import ByteTokenizer, make, reference_tokens, run_to_completion, step

from kvcache import KVCacheManager
from scheduler import QueueLoad, SamplingParams, Scheduler, SchedulerConfig, SequenceStatus
from scheduler.request import Request, Seq

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.mark.parametrize("kwargs, field", [
    ({"n": 0}, "n"), ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"min_p": 1.5}, "min_p"), ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"stop": [""]}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"logprobs": 21}, "logprobs"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"seed": 1.5}, "seed"),
    ({"logit_bias": {5: 101}}, "logit_bias"), ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"), ({"logit_bias": [(5, 1.0)]}, "logit_bias"),
])
def test_sampling_params_reject_bad_values_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_and_normalisation() -> None:
    sp = SamplingParams(stop="END", top_k=-1)
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.max_tokens, sp.stop) == (
        1, 1.0, 1.0, 0, 16, ["END"])
    assert SamplingParams(temperature=0).greedy and not sp.greedy
    assert sp.logit_bias is None and not sp.uses_penalties
    biased = SamplingParams(logit_bias={7: -100, 3: 2})
    assert biased.logit_bias == {7: -100.0, 3: 2.0} and biased.uses_penalties
    assert SamplingParams(logit_bias={}).logit_bias is None


@pytest.mark.parametrize("kwargs, match", [
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_batched_tokens": 8, "max_num_seqs": 16}, "max_num_batched_tokens"),
    ({"enable_chunked_prefill": False, "max_num_batched_tokens": 512, "max_model_len": 1024},
     "chunked prefill"),
    ({"preemption_mode": "evict"}, "preemption_mode"),
])
def test_config_rejects_bad_knobs(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(**kwargs)


def test_swap_mode_without_cpu_blocks_is_rejected_and_default_follows_swap_space() -> None:
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        Scheduler(SchedulerConfig(preemption_mode="swap"), KVCacheManager(8, 0, 4))
    assert Scheduler(SchedulerConfig(), KVCacheManager(8, 0, 4)).preemption_mode == "recompute"
    assert Scheduler(SchedulerConfig(), KVCacheManager(8, 4, 4)).preemption_mode == "swap"


@pytest.mark.parametrize("prompt, sp, match", [
    ([], SamplingParams(), "empty"),
    (list(range(2, 66)), SamplingParams(), "prompt has 64 tokens; max_model_len is 64"),
    (list(range(2, 40)), SamplingParams(), "needs 10 KV blocks .* only 8"),
    ([5] * 29, SamplingParams(n=2), "needs 9 KV blocks"),
    ([5, 6], SamplingParams(n=5), "n=5 exceeds max_num_seqs=4"),
    ([5, 6], SamplingParams(stop=["x"]), "stop strings need a tokenizer"),
    ([5, -1], SamplingParams(), "prompt token ids"),
])
def test_add_request_rejects_requests_that_could_never_run(prompt, sp, match) -> None:
    sched, _, _ = make(num_gpu_blocks=8, max_num_seqs=4, max_num_batched_tokens=8,
                       max_model_len=64)
    with pytest.raises(ValueError, match=match):
        sched.add_request("r", prompt, sp)
    assert not sched.has_unfinished()


def test_duplicate_request_id_is_rejected() -> None:
    sched, _, _ = make()
    sched.add_request("r", [5], SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request("r", [6], SamplingParams())


def test_state_machine_rejects_illegal_transitions() -> None:
    seq = Seq(0, 0, [5], 1, SequenceStatus.WAITING)
    req = Request("r", [5], SamplingParams(), 0.0, None, seq, frozenset(), 64)
    with pytest.raises(RuntimeError, match="WAITING -> SWAPPED"):
        req.move(SequenceStatus.SWAPPED)
    req.move(SequenceStatus.RUNNING)
    req.move(SequenceStatus.PREEMPTED)
    req.move(SequenceStatus.RUNNING)
    assert req.finish_seq(seq, SequenceStatus.FINISHED_LENGTH)
    assert req.status is SequenceStatus.FINISHED_LENGTH and seq.status.finish_reason == "length"
    with pytest.raises(RuntimeError, match="FINISHED_LENGTH -> RUNNING"):
        req.move(SequenceStatus.RUNNING)


def test_max_model_len_caps_output_with_length() -> None:
    sched, kv, worker = make(max_model_len=10, max_num_batched_tokens=16, max_num_seqs=4)
    sched.add_request("a", [5, 6, 7, 8], SamplingParams(max_tokens=None, **GREEDY))
    got = run_to_completion(sched, kv, worker)
    assert len(got[("a", 0)].token_ids) == 6 and got[("a", 0)].finish_reason == "length"


def test_stats_count_queues_tokens_and_preemptions() -> None:
    sched, kv, worker = make(num_gpu_blocks=4, num_cpu_blocks=8, max_num_batched_tokens=16,
                             max_num_seqs=4)
    sched.add_request("a", list(range(100, 107)), SamplingParams(max_tokens=4, **GREEDY))
    step(sched, worker)
    sched.add_request("b", list(range(200, 208)), SamplingParams(max_tokens=3, **GREEDY))
    sched.add_request("c", list(range(300, 308)), SamplingParams(max_tokens=3, **GREEDY))
    step(sched, worker)
    step(sched, worker)
    s = sched.stats()
    assert (s.num_running, s.num_swapped, s.num_waiting, s.num_running_seqs) == (1, 1, 1, 1)
    assert (s.preemptions_swap, s.preemptions_recompute) == (1, 0)
    assert (s.prompt_tokens_total, s.generation_tokens_total, s.num_steps) == (15, 4, 3)
    assert (s.num_free_gpu_blocks, s.num_free_cpu_blocks, s.gpu_usage) == (1, 6, 0.75)
    # What the replica reports to the router (RequestQueues.load): b swapped out counts as
    # waiting and owes no prompt token, c waiting owes its 8, a decodes.
    assert sched.queues.load() == QueueLoad(2, 1, 8, frozenset("abc"))


def test_queue_load_counts_prompt_tokens_owed_past_the_cached_prefix() -> None:
    """What a replica reports to the request router with its KV events (RequestQueues.load)."""
    sched, kv, worker = make(num_gpu_blocks=32, max_num_batched_tokens=8, max_num_seqs=4)
    sp = SamplingParams(max_tokens=4, **GREEDY)
    sched.add_request("a", list(range(10, 30)), sp)
    assert sched.queues.load() == QueueLoad(1, 0, 20, frozenset("a"))
    step(sched, worker)  # a's first chunk of 8: its two full blocks enter the prefix cache
    assert sched.queues.load() == QueueLoad(0, 1, 12, frozenset("a"))
    sched.add_request("b", list(range(10, 18)) + [99] * 10, sp)  # a's first 8 tokens, then 10
    sched.add_request("c", list(range(10, 30)) + [5] * 4, sp)  # a's whole prompt, then 4
    # b misses past the cached blocks; c only its last block: a computes the rest first
    assert sched.queues.load() == QueueLoad(2, 1, 12 + 10 + 4, frozenset("abc"))
    step(sched, worker)  # a's second chunk
    assert sched.queues.load() == QueueLoad(2, 1, 4 + 10 + 4, frozenset("abc"))


def test_byte_level_text_of_a_whole_run_equals_decode_of_its_tokens() -> None:
    tok = ByteTokenizer()
    sched, kv, worker = make(num_gpu_blocks=64, max_num_batched_tokens=16, max_num_seqs=8,
                             tokenizer=tok)
    sps = {}
    for i in range(6):
        # A stop string that never matches still holds text back; it is flushed at the end.
        sps[f"r{i}"] = SamplingParams(n=1 + i % 2, max_tokens=12 + i, temperature=0.0,
                                      ignore_eos=i % 3 == 0, skip_special_tokens=i % 2 == 0,
                                      stop=["qqqq"] if i % 2 else [])
        sched.add_request(f"r{i}", [200 + i, 201, 202], sps[f"r{i}"])
    got = run_to_completion(sched, kv, worker)
    for rid, sp in sps.items():
        for j in range(sp.n):
            c = got[(rid, j)]
            assert c.token_ids == reference_tokens([200 + int(rid[1:]), 201, 202], sp, j, 4096)
            stopped_by_eos = c.finish_reason == "stop"
            shown = c.token_ids[:-1] if stopped_by_eos else c.token_ids
            assert c.text == tok.decode(shown, skip_special_tokens=sp.skip_special_tokens)


def test_owned_step_result_copies_every_array() -> None:
    from scheduler import StepResult

    buf = np.arange(12, dtype=np.int64)
    r = StepResult(3, buf[:2], buf[2:4], np.zeros(2, np.float32), buf[4:8].reshape(2, 2),
                   np.ones((2, 2), np.float32), forward_seconds=0.5)
    o = r.owned()
    assert (o.step_id, o.forward_seconds) == (3, 0.5)
    for name in ("seq_ids", "token_ids", "logprobs", "top_token_ids", "top_logprobs"):
        assert np.array_equal(getattr(o, name), getattr(r, name)), name
        assert not np.shares_memory(getattr(o, name), getattr(r, name)), name
    assert StepResult(1, buf[:1], buf[1:2]).owned().logprobs is None
