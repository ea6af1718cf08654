"""The output processor (cluster/engine/output_processor.py): deltas from the scheduler's token ids and
finish decisions, stop strings handed back to the scheduler, abort and capacity deltas."""

from __future__ import annotations

import numpy as np
import pytest

from cluster.engine.output_processor import OutputProcessor
from kvcache import KVCacheManager
from scheduler import SamplingParams, Scheduler, SchedulerConfig, StepResult


@pytest.fixture(scope="module")
def qwen(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def _engine(tokenizer, num_gpu_blocks: int = 32) -> tuple[Scheduler, OutputProcessor]:
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
                      KVCacheManager(num_gpu_blocks, 0, 4))
    return sched, OutputProcessor(sched, tokenizer)


def _add(sched: Scheduler, proc: OutputProcessor, rid: str, prompt: list[int],
         sp: SamplingParams) -> None:
    proc.validate(sp)
    sched.add_request(rid, prompt, sp)
    proc.add_request(rid, prompt, sp)


def _step(sched: Scheduler, proc: OutputProcessor, tokens: list[int], defer: bool = False):
    """One step in which the sampled sequences draw `tokens` in batch order."""
    plan = sched.schedule()
    sampled = plan.seq_ids[plan.do_sample]
    result = StepResult(plan.step_id, sampled, np.array(tokens[:len(sampled)], dtype=np.int64))
    return plan, proc.process(sched.apply_result(plan, result), defer)


def test_stop_string_on_the_last_allowed_token_reports_stop(qwen) -> None:
    ids = qwen.encode(" a café b")
    (cafe,) = qwen.encode(" café")
    n = ids.index(cafe) + 1  # the stop string completes on the last allowed token
    sched, proc = _engine(qwen)
    _add(sched, proc, "a", qwen.encode("Hi"), SamplingParams(max_tokens=n, stop=["café"]))
    outs = [_step(sched, proc, [t])[1] for t in ids[:n]]
    last = outs[-1][0]
    assert last.finished and last.outputs[0].finish_reason == "stop"
    assert last.outputs[0].stop_reason == "café"
    text = "".join(o[0].outputs[0].text for o in outs)
    assert text == " a "  # cut before the stop string, the window flushed up to it
    assert not sched.has_unfinished() and not proc._states


def test_stop_string_finishes_the_sequence_in_the_scheduler_at_once(qwen) -> None:
    ids = qwen.encode(" x zzz y y y")
    sched, proc = _engine(qwen)
    _add(sched, proc, "a", qwen.encode("Hi"), SamplingParams(max_tokens=20, stop=["zzz"]))
    kv = sched.kv
    outs, free = [], []
    while sched.has_unfinished():
        outs += _step(sched, proc, [ids[len(outs)]])[1]
        free.append(kv.num_free_gpu_blocks)
    assert outs[-1].outputs[0].stop_reason == "zzz" and outs[-1].finished
    assert free[-2] < 32 and free[-1] == 32  # its blocks went back in the step that stopped it
    plan = sched.schedule()  # the next plan drops its worker state
    assert plan.is_empty and plan.dropped_seq_ids == [0]


def test_a_token_in_flight_after_a_stop_string_is_dropped(qwen) -> None:
    ids = qwen.encode(" x café y y")
    (cafe,) = qwen.encode(" café")
    sched, proc = _engine(qwen)
    _add(sched, proc, "a", qwen.encode("Hi"), SamplingParams(max_tokens=20, stop=["café"]))
    drawn = 0

    def launch() -> tuple:
        nonlocal drawn  # the worker runs each plan at once, drawing the next scripted token
        plan = sched.schedule()
        k = int(plan.do_sample.sum())
        result = StepResult(plan.step_id, plan.seq_ids[plan.do_sample],
                            np.array(ids[drawn:drawn + k], dtype=np.int64))
        drawn += k
        return plan, result

    inflight, got = [launch()], []
    while inflight:
        if sched.has_unfinished():
            inflight.append(launch())  # one plan ahead of the result, as async scheduling
        plan, result = inflight.pop(0)
        for out in proc.process(sched.apply_result(plan, result)):
            got += out.outputs[0].token_ids
    assert got == ids[:ids.index(cafe) + 1]
    assert drawn == len(got) + 1  # the token after the stop string was computed in vain
    assert sched.kv.num_free_gpu_blocks == 32


def test_abort_delta_names_only_the_sequences_still_live() -> None:
    sched, proc = _engine(None)
    _add(sched, proc, "a", [5, 6, 7], SamplingParams(n=2, max_tokens=8, stop_token_ids=[42],
                                                     logprobs=0, ignore_eos=True))
    plan = sched.schedule()  # the parent's prompt but its last token: nothing samples
    assert proc.process(sched.apply_result(plan, None)) == []
    plan = sched.schedule()  # the fork: both sequences sample
    result = StepResult(plan.step_id, plan.seq_ids, np.array([42, 9], dtype=np.int64),
                        logprobs=np.zeros(2, np.float32))
    (out,) = proc.process(sched.apply_result(plan, result))
    assert [(c.index, c.finish_reason, len(c.logprobs)) for c in out.outputs] == [
        (0, "stop", 1), (1, None, 1)]
    out = proc.abort("a")
    assert out.finished and [(c.index, c.finish_reason, c.logprobs) for c in out.outputs] == [
        (1, "abort", [])]
    assert proc.abort("a") is None and not proc._states


def test_requests_without_text_or_logprobs_keep_no_state_and_stop_strings_need_text() -> None:
    sched, proc = _engine(None)
    _add(sched, proc, "a", [5, 6], SamplingParams(max_tokens=2, ignore_eos=True))
    assert not proc._states
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        _add(sched, proc, "b", [5, 6], SamplingParams(stop=["x"]))
    assert list(sched.requests) == ["a"]


def test_deferred_text_is_filled_in_token_order_and_stop_strings_never_wait(qwen) -> None:
    ids = qwen.encode(" one two three")
    sched, proc = _engine(qwen)
    _add(sched, proc, "plain", qwen.encode("Hi"), SamplingParams(max_tokens=3, ignore_eos=True))
    _add(sched, proc, "stop", qwen.encode("Hi"), SamplingParams(max_tokens=3, ignore_eos=True,
                                                                 stop=["zzz"]))
    texts: dict[str, list] = {"plain": [], "stop": []}
    for i in range(3):
        _, outs = _step(sched, proc, [ids[i], ids[i]], defer=True)
        for out in outs:
            texts[out.request_id].append(out.outputs[0])
        if i < 2:  # (in the last step the stop-string request finishes inline, which
            # flushes the text owed so far first)
            assert texts["plain"][-1].text == ""  # deferred
        proc.finish_text()
        assert texts["plain"][-1].text == qwen.decode([ids[i]])
    assert "".join(c.text for c in texts["plain"]) == " one two three"
    assert "".join(c.text for c in texts["stop"]) == " one two three"


def test_a_sequence_the_cache_cannot_hold_finishes_with_its_held_back_text(qwen) -> None:
    ids = qwen.encode(" one two three four five six seven eight nine")
    sched, proc = _engine(qwen, num_gpu_blocks=2)  # 8 slots in all
    prompt = qwen.encode("Hi")
    _add(sched, proc, "a", prompt, SamplingParams(max_tokens=20, ignore_eos=True, stop=["zzz"]))
    outs = []
    while sched.has_unfinished():
        outs += _step(sched, proc, ids[len(outs):len(outs) + 1])[1]
    last = outs[-1]
    assert last.finished and last.outputs[0].token_ids == [] and last.outputs[0].finish_reason \
        == "length"
    got = [t for o in outs for t in o.outputs[0].token_ids]
    assert len(prompt) + len(got) == 8 + 1  # every slot used, and the last token never computed
    assert last.outputs[0].text != "" and "".join(o.outputs[0].text for o in outs) == \
        qwen.decode(got)
