"""A long step is not a dead rank (cluster/engine/dag_calls.py), on a Ray TP group of qwen3-tiny
driven through each of its plan transports (the host channel its ranks on this host get,
cluster/engine/host_channel.py, and the compiled graph that ranks on other hosts get): a step
that runs past the graph's read timeout finishes with no rebuild and HF's tokens; a rank killed
mid-step is noticed within seconds (a rebuild, then the same tokens), not after STEP_BOUND_S; a
step past the bound fails its group like a dead rank, with a message that names the bound.

A step is made long without a test hook: rank 0 samples a constrained row only once the
engine has posted that row's grammar bitmask (cluster/engine/ray_worker.py), and the tests
hold the post back (the executor's `provide_bitmask`), so the step waits inside the ranks'
graph loop. Ray's read timeout is lowered from 10 s to 1 s (DAGContext.get_timeout, which
RAY_CGRAPH_get_timeout sets) and the slices to 0.2 s, to keep the tests short.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from cluster import LLM, SamplingParams, StructuredOutputsParams
from cluster.engine import dag_calls, host_channel, llm_engine

PROMPTS = [{"prompt_token_ids": list(range(100, 140))},
           {"prompt_token_ids": list(range(500, 530))}]
PARAMS = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=12,
                         structured_outputs=StructuredOutputsParams(regex="[a-z]{3,8}"))]
RAY_READ_TIMEOUT_S = 1  # (Ray's default: 10)


def hf_greedy(path: str, prompt: list[int], n: int) -> list[int]:
    """The oracle: `n` greedy tokens of transformers' model, one full forward each, fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[0, -1].argmax().view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist()


def tokens(outputs: list) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module", params=["host channel", "compiled graph"])
def llm(request: pytest.FixtureRequest, ray_cluster: None) -> Iterator[LLM]:
    from ray.dag import DAGContext

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(host_channel.ENV_KNOB, "1" if request.param == "host channel" else "0")
        ctx = DAGContext.get_current()
        mp.setattr(ctx, "get_timeout", RAY_READ_TIMEOUT_S)  # read when a graph is compiled
        mp.setattr(ctx, "submit_timeout", RAY_READ_TIMEOUT_S)
        mp.setattr(dag_calls, "SLICE_S", 0.2)
        with LLM("qwen3-tiny", tensor_parallel_size=2, worker_num_cpus=0.5, max_num_seqs=4,
                 async_scheduling=False) as engine:
            group = engine.engine.executor._g
            assert (group.channel is not None) == (request.param == "host channel")
            assert (group.dag is not None) == (request.param == "compiled graph")
            yield engine


@pytest.fixture(scope="module")
def reference(llm: LLM, tiny_model_path: str) -> list[list[int]]:
    """The tokens with no step held back; the unconstrained row's are HF's."""
    ref = tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    assert ref[0] == hf_greedy(tiny_model_path, PROMPTS[0]["prompt_token_ids"], 12)
    assert len(ref[1]) >= 3
    return ref


def hold_first_bitmask(monkeypatch: pytest.MonkeyPatch, llm: LLM,
                       delay_s: float | None) -> None:
    """The engine's first bitmask post reaches rank 0 `delay_s` later (None: never); the
    others at once."""
    executor = llm.engine.executor
    real = executor.provide_bitmask
    held: list[int] = []

    def provide_bitmask(handle: int, bitmask: Any) -> None:
        if held:
            return real(handle, bitmask)
        held.append(handle)
        if delay_s is not None:
            threading.Timer(delay_s, real, (handle, bitmask)).start()
        return None

    monkeypatch.setattr(executor, "provide_bitmask", provide_bitmask)


def record_rebuilds(monkeypatch: pytest.MonkeyPatch, llm: LLM) -> list[tuple[float, str]]:
    """(when, why) of each rebuild the engine starts."""
    calls: list[tuple[float, str]] = []
    real = llm_engine.rebuild_or_raise

    def rebuild_or_raise(executor: Any, error: Exception) -> None:
        calls.append((time.monotonic(), str(error)))
        real(executor, error)

    monkeypatch.setattr(llm_engine, "rebuild_or_raise", rebuild_or_raise)
    return calls


def test_a_step_longer_than_the_graphs_read_timeout_finishes_without_a_rebuild(
        llm: LLM, reference: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    recoveries = llm.engine.recoveries
    rebuilds = record_rebuilds(monkeypatch, llm)
    hold_first_bitmask(monkeypatch, llm, 3 * RAY_READ_TIMEOUT_S)
    start = time.monotonic()
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert time.monotonic() - start >= 3 * RAY_READ_TIMEOUT_S  # one step was that long
    assert tokens(outputs) == reference
    assert rebuilds == [] and llm.engine.recoveries == recoveries


def test_a_rank_killed_mid_step_is_noticed_within_seconds(
        llm: LLM, reference: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 waits in the step for a bitmask that never comes (its own wait: 120 s; the
    executor's bound: 30 min); rank 1 is killed meanwhile."""
    import ray

    recoveries = llm.engine.recoveries
    rebuilds = record_rebuilds(monkeypatch, llm)
    hold_first_bitmask(monkeypatch, llm, None)
    killed: list[float] = []

    def kill() -> None:
        killed.append(time.monotonic())
        ray.kill(llm.engine.executor.workers[1])

    threading.Timer(1.5, kill).start()
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert len(rebuilds) == 1 and killed
    assert rebuilds[0][0] - killed[0] < 10, rebuilds
    assert tokens(outputs) == reference  # recomputed on the new group
    assert llm.engine.recoveries == recoveries + 1
    assert llm.engine.executor.rebuilds_without_step == 0  # its steps completed


def test_a_step_past_the_bound_fails_the_group_naming_the_bound(
        llm: LLM, reference: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dag_calls, "STEP_BOUND_S", 3.0)
    rebuilds = record_rebuilds(monkeypatch, llm)
    hold_first_bitmask(monkeypatch, llm, None)
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [why for _, why in rebuilds] == [
        "a tensor-parallel worker failed: StepBoundError: a step did not finish within "
        "STEP_BOUND_S = 3 s (cluster/engine/dag_calls.py) although every rank is alive"]
    assert tokens(outputs) == reference
