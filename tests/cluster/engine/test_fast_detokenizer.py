"""StreamDetokenizer (tokenizers' DecodeStream) gives exactly IncrementalDetokenizer's deltas on
the real Qwen3 tokenizer, and an output processor using it streams the same outputs."""

from __future__ import annotations

import random

import numpy as np
import pytest

from cluster.engine.detokenizer import IncrementalDetokenizer
from cluster.engine.fast_detokenizer import StreamDetokenizer, detokenizer_factory
from cluster.engine.output_processor import OutputProcessor
from kvcache import KVCacheManager
from scheduler import SamplingParams, Scheduler, SchedulerConfig, StepResult

TEXT = "你好，世界！🦜 naïve café 👩\u200d👩\u200d👧 𝄞龘 done."


@pytest.fixture(scope="module")
def qwen(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def stream(detok, ids: list[int]) -> list[str]:
    return [detok.step(i) for i in ids] + [detok.flush()]


def both(qwen, prompt: list[int], ids: list[int], skip: bool = True) -> tuple[list[str], list[str]]:
    return (stream(StreamDetokenizer(qwen, prompt, skip), ids),
            stream(IncrementalDetokenizer(qwen, prompt, skip), ids))


def test_deltas_equal_the_python_detokenizer_and_decode(qwen) -> None:
    ids = qwen.encode(TEXT)
    fast, ref = both(qwen, qwen.encode("Say hi:"), ids)
    assert fast == ref
    assert "".join(fast) == qwen.decode(ids) == TEXT
    assert fast.count("") > 5  # the emoji and rare characters span several tokens


def test_a_truncated_character_is_flushed_as_decode_spells_it(qwen) -> None:
    ids = qwen.encode("ab𝄞")
    cut = ids[:-1]
    assert qwen.decode(cut).endswith("\ufffd")  # 𝄞 is split over byte-level tokens
    fast, ref = both(qwen, [], cut)
    assert fast == ref
    assert fast[-1].endswith("\ufffd") and "".join(fast) == qwen.decode(cut)


@pytest.mark.parametrize("skip", [True, False])
def test_special_and_out_of_vocabulary_ids(qwen, skip: bool) -> None:
    end = qwen.convert_tokens_to_ids("<|im_end|>")
    head, tail = qwen.encode("回答：") + [end], qwen.encode(" x")
    fast, ref = both(qwen, qwen.encode("Q"), head + [len(qwen) + 7] + tail, skip)
    assert fast == ref
    assert "".join(fast) == qwen.decode(head + tail, skip_special_tokens=skip)


def test_random_ids_after_a_random_prompt(qwen) -> None:
    rng = random.Random(0)
    prompt = [rng.randrange(100, 150000) for _ in range(30)]
    ids = [rng.randrange(100, 150000) for _ in range(600)]
    fast, ref = both(qwen, prompt, ids)
    assert fast == ref


def test_factory_only_for_fast_tokenizers(qwen) -> None:
    make = detokenizer_factory(qwen)
    assert isinstance(make([1, 2], True), StreamDetokenizer)
    assert detokenizer_factory(object()) is None


def _run(qwen, factory) -> list[tuple]:
    """Three requests (one with a stop string) decoded by a scripted model."""
    ids = qwen.encode(TEXT)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
                      KVCacheManager(64, 0, 4))
    proc = OutputProcessor(sched, qwen, factory)
    prompt = qwen.encode("Tell me:")
    for rid, sp in (("a", SamplingParams(max_tokens=len(ids), ignore_eos=True)),
                    ("b", SamplingParams(max_tokens=len(ids), stop=["café"])),
                    ("c", SamplingParams(max_tokens=5, ignore_eos=True,
                                         skip_special_tokens=False))):
        sched.add_request(rid, prompt, sp)
        proc.add_request(rid, prompt, sp)
    got, pos = [], {}
    while sched.has_unfinished():
        plan = sched.schedule()
        sampled = plan.seq_ids[plan.do_sample]
        tokens = []
        for sid in sampled.tolist():
            pos[sid] = pos.get(sid, -1) + 1
            tokens.append(ids[pos[sid]])
        result = StepResult(plan.step_id, sampled, np.array(tokens, dtype=np.int64))
        for out in proc.process(sched.apply_result(plan, result)):
            for c in out.outputs:
                got.append((out.request_id, tuple(c.token_ids), c.text, c.finish_reason))
    return got


def test_scheduler_streams_the_same_outputs_with_either_detokenizer(qwen) -> None:
    fast = _run(qwen, detokenizer_factory(qwen))
    assert fast == _run(qwen, None)
    text = {r: "".join(t for rid, _, t, _ in fast if rid == r) for r in "abc"}
    assert text["a"] == TEXT and text["b"] == TEXT[:TEXT.index("café")]
