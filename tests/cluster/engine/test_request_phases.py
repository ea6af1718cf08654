"""vLLM's request-phase histograms from a real engine: every finished request is observed once
in each phase, and the phases add up to what they should."""

from __future__ import annotations

from cluster import LLM, SamplingParams


def test_each_finished_request_is_observed_in_every_phase_once(tiny_model_path: str) -> None:
    llm = LLM("qwen3-tiny", tensor_parallel_size=1)
    try:
        llm.generate([{"prompt_token_ids": [5, 6, 7] * 10}, {"prompt_token_ids": [9, 10] * 20}],
                     SamplingParams(max_tokens=4, ignore_eos=True))
        m = llm.engine.metrics()
    finally:
        llm.shutdown()
    phases = [m[f"request_{p}_time_seconds"] for p in ("queue", "prefill", "decode", "inference")]
    assert [h.count for h in phases] == [2, 2, 2, 2]
    queue, prefill, decode, inference = (h.sum for h in phases)
    assert min(queue, prefill, decode) >= 0.0 and decode > 0.0
    assert abs(inference - (prefill + decode)) < 1e-9
    assert queue + inference <= m["e2e_request_latency_seconds"].sum + 1e-9
