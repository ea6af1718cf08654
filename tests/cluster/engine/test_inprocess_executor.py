"""The in-process executor on CPU runs the worker on one helper thread (cluster/engine/executor.py),
so the caller's thread, a Serve replica's event loop, is free while torch computes a step."""

from __future__ import annotations

import threading

import pytest

from cluster import LLM, SamplingParams


def test_cpu_steps_run_off_the_callers_thread_and_give_the_same_tokens(
        monkeypatch: pytest.MonkeyPatch) -> None:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": [11, 22, 33, 44]}, {"prompt_token_ids": [5, 6, 7]}]
    with LLM("qwen3-tiny", max_num_seqs=4, device="cpu") as llm:
        worker = llm.engine.executor.worker
        threads: set[int] = set()
        launch = worker.launch
        monkeypatch.setattr(worker, "launch", lambda plan, *a, **k: threads.add(
            threading.get_ident()) or launch(plan, *a, **k))
        first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert threads and threading.get_ident() not in threads and len(threads) == 1
        monkeypatch.setattr(worker, "launch", launch)
        again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert first == again and all(len(t) == 6 for t in first)
