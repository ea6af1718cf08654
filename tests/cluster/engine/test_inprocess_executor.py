"""The in-process executor on CPU runs the worker on one helper thread (cluster/engine/executor.py),
so the caller's thread, a Serve replica's event loop, is free while torch computes a step."""

from __future__ import annotations

import gc
import threading
import weakref

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


# What an engine holds on its device must go when it shuts down, and when its start fails
# part-way: the GPU report's test workers share one GPU, and a failed start's traceback (which
# pytest keeps) held 69 GiB of KV cache there through every later test of its worker.
_SMALL = dict(num_gpu_blocks_override=16, max_num_seqs=4, device="cpu", swap_space=0.01)


def _watch_the_cache(monkeypatch: pytest.MonkeyPatch, fail: bool) -> list[weakref.ref]:
    """Weak references to the KV cache and a weight, taken as the worker's cache is made;
    `fail`: the start then fails there (as the CUDA warm-up's out-of-memory did)."""
    from workers.worker import Worker

    refs: list[weakref.ref] = []
    init_cache = Worker.init_cache

    def watched(self: Worker, *args: object) -> None:
        init_cache(self, *args)
        refs[:] = [weakref.ref(self.cache_engine.gpu_cache),
                   weakref.ref(next(self.model.parameters()))]
        if fail:
            raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(Worker, "init_cache", watched)
    return refs


def test_shutdown_frees_the_cache_and_weights_while_the_llm_object_lives(
        monkeypatch: pytest.MonkeyPatch) -> None:
    refs = _watch_the_cache(monkeypatch, fail=False)
    with LLM("qwen3-tiny", **_SMALL) as llm:
        llm.generate([{"prompt_token_ids": [11, 22, 33]}],
                     SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        assert all(r() is not None for r in refs)
    gc.collect()
    assert llm.engine is not None and [r() for r in refs] == [None, None]


def test_a_start_failing_in_the_executor_frees_the_cache_while_its_error_is_kept(
        monkeypatch: pytest.MonkeyPatch) -> None:
    refs = _watch_the_cache(monkeypatch, fail=True)
    with pytest.raises(RuntimeError, match="simulated") as kept:
        LLM("qwen3-tiny", **_SMALL)
    gc.collect()
    assert kept.value.__traceback__ is not None  # (its frames still hold the worker and model)
    assert refs[0]() is None, "the KV cache outlived the failed start"


def test_a_start_failing_after_the_executor_shuts_it_down(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import cluster.engine.llm_engine as llm_engine

    refs = _watch_the_cache(monkeypatch, fail=False)

    def refuse(*args: object, **kwargs: object) -> None:
        raise ValueError("bad structured-output backend (simulated)")

    monkeypatch.setattr(llm_engine, "StructuredOutputManager", refuse)
    with pytest.raises(ValueError, match="simulated") as kept:
        LLM("qwen3-tiny", **_SMALL)
    gc.collect()
    assert kept.value.__traceback__ is not None
    assert [r() for r in refs] == [None, None]
