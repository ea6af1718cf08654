"""A decode engine whose ranks run in its own process (the in-process executor, what a tp 1
Serve replica runs) pulls a request's payloads from Ray's object store on a background thread
(kv_transport.PayloadPuller) and writes them into its blocks on one too: its steps go on while
a pull or a write is in flight, the request is admitted once its blocks hold the payloads,
and a pull that fails or a request aborted during a pull or a write leaves nothing behind
(qwen3-tiny, tp 1, in-process engines on the session's Ray cluster)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from pd_testlib import (
    RAY_PROMPT,
    assert_imported,
    assert_no_block_held,
    colocated,
    drain,
    prefill,
    ray_engine,
    tokens_of,
)

from cluster.engine import kv_transport
from cluster.engine.executor import InProcessExecutor
from scheduler import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# How long a gated pull waits for the test to open its gate before it gives up (a loop that
# pulled on its own thread would sit here, and the test would then fail, not hang).
GATE_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def engines(ray_cluster: None, tiny_model_path: str) -> Iterator[tuple]:
    made = [ray_engine(kv_role="prefill"), ray_engine(kv_role="decode", kv_transfer_timeout_s=30.0),
            ray_engine()]
    assert not any(e.config.uses_ray for e in made)  # (in-process ranks, Ray up)
    yield tuple(made)
    for e in made:
        e.shutdown()


@pytest.fixture(autouse=True)
def _no_leak(engines: tuple) -> Iterator[None]:
    yield
    for e in engines:
        assert_no_block_held(e)


def _hold(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str
          ) -> tuple[threading.Event, list[str]]:
    """Calls of `owner.name` wait for the event; the list names the threads that made them."""
    opened, threads = threading.Event(), []
    real = getattr(owner, name)

    def gated(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        opened.wait(GATE_TIMEOUT_S)
        return real(*args)

    monkeypatch.setattr(owner, name, gated)
    return opened, threads


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, list[str]]]:
    """Object-store fetches wait for the event."""
    opened, threads = _hold(monkeypatch, kv_transport, "fetch")
    yield opened, threads
    opened.set()


@pytest.fixture
def write_gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, list[str]]]:
    """Writes of pulled payloads into their blocks wait for the event."""
    opened, threads = _hold(monkeypatch, InProcessExecutor, "write_kv")
    yield opened, threads
    opened.set()


@pytest.mark.parametrize("held", ["gate", "write_gate"])
def test_decode_steps_go_on_while_a_payload_is_pulled_or_written(
        engines: tuple, held: str, request: pytest.FixtureRequest) -> None:
    p, d, c = engines
    opened, threads = request.getfixturevalue(held)
    first = 301 if held == "gate" else 305
    prompt = [first] + RAY_PROMPT[1:]
    want = colocated(c, f"held-c{first}", prompt, GREEDY)
    transfer = prefill(p, f"held{first}", prompt, GREEDY)
    running = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    d.add_request(f"running{first}", [first + 1] + RAY_PROMPT[1:20], running)
    outs = d.step()
    before = d.metrics()
    d.add_request(f"held{first}", prompt, GREEDY, kv_transfer_params=transfer)
    for _ in range(200):  # until the held stage is reached (the pull: at once)
        if threads:
            break
        outs += d.step()
    steps = len(tokens_of(outs, f"running{first}"))
    for _ in range(5):  # the pull or the write waits at the gate; the running stream goes on
        outs += d.step()
    assert len(tokens_of(outs, f"running{first}")) == steps + 5
    assert d.kv_transfers.pending and tokens_of(outs, f"held{first}") == []
    assert threads and all(t.startswith("kv-pull") for t in threads)
    opened.set()
    outs += drain(d)
    assert [transfer.first_token] + tokens_of(outs, f"held{first}") == want
    assert len(tokens_of(outs, f"running{first}")) == 40
    assert_imported(before, d.metrics(), transfer)


def test_a_pull_that_fails_falls_back_to_computing_the_prompt(engines: tuple) -> None:
    import ray

    @ray.remote(num_cpus=0.01)
    def failed() -> None:
        raise RuntimeError("payload lost")

    p, d, c = engines
    prompt = [303] + RAY_PROMPT[1:40]
    want = colocated(c, "pull-failed-c", prompt, GREEDY)
    transfer = prefill(p, "pull-failed", prompt, GREEDY)
    transfer.payloads = [failed.remote()]
    before = d.metrics()
    d.add_request("pull-failed", prompt, GREEDY, kv_transfer_params=transfer)
    assert [transfer.first_token] + tokens_of(drain(d), "pull-failed") == want
    after = d.metrics()
    assert after["kv_transfer_fallbacks_total"] == before["kv_transfer_fallbacks_total"] + 1
    assert after["kv_transfer_imports_total"] == before["kv_transfer_imports_total"]


def test_abort_during_a_pull_leaves_nothing(engines: tuple, gate: tuple) -> None:
    p, d, _ = engines
    opened, _ = gate
    prompt = [304] + RAY_PROMPT[1:]
    transfer = prefill(p, "pull-abort", prompt, GREEDY)
    before = d.metrics()
    d.add_request("pull-abort", prompt, GREEDY, kv_transfer_params=transfer)
    d.step()
    d.abort("pull-abort")
    opened.set()
    assert not d.has_unfinished() and tokens_of(drain(d), "pull-abort") == []
    after = d.metrics()
    assert after["kv_transfer_imports_total"] == before["kv_transfer_imports_total"]
    assert after["kv_transfer_fallbacks_total"] == before["kv_transfer_fallbacks_total"]


def test_abort_during_a_write_gives_the_blocks_back_after_it(engines: tuple, write_gate: tuple
                                                             ) -> None:
    p, d, _ = engines
    opened, threads = write_gate
    prompt = [307] + RAY_PROMPT[1:]
    transfer = prefill(p, "write-abort", prompt, GREEDY)
    free = d.scheduler.kv.num_free_gpu_blocks
    before = d.metrics()
    d.add_request("write-abort", prompt, GREEDY, kv_transfer_params=transfer)
    for _ in range(200):
        d.step()
        if threads:
            break
    assert threads
    d.abort("write-abort")
    d.step()  # (the write is still held: its blocks stay reserved)
    assert d.scheduler.kv.num_free_gpu_blocks == free - transfer.num_blocks
    opened.set()
    assert tokens_of(drain(d), "write-abort") == []
    after = d.metrics()
    assert after["kv_transfer_imports_total"] == before["kv_transfer_imports_total"]
    assert after["kv_transfer_fallbacks_total"] == before["kv_transfer_fallbacks_total"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_payload_crosses_the_object_store_as_it_was(ray_cluster: None, dtype: torch.dtype
                                                      ) -> None:
    payload = torch.arange(2 * 4 * 3 * 16 * 2 * 32, dtype=torch.float32).view(
        2, 4, 3, 16, 2, 32).to(dtype)
    got = kv_transport.fetch(kv_transport.publish(payload), timeout_s=30.0)
    assert got.dtype == dtype and got.shape == payload.shape
    assert torch.equal(got, payload)
