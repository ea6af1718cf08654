"""The KV transport's choice per device and its refusals (`kv_transport`), and a prefill
rank's payload stash (cluster/engine/rdt_transport.py); no Ray needed."""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch

from cluster.engine.config import EngineConfig
from cluster.engine.kv_transport import KVTransferError, ready
from cluster.engine.rdt_transport import PayloadStash, RDTHandle, resolve_kv_transport

_CUPY = importlib.util.find_spec("cupy") is not None


def _config(**kw: object) -> EngineConfig:
    return EngineConfig(model="qwen3-tiny", **kw)


def test_kv_transport_is_validated() -> None:
    with pytest.raises(ValueError, match=r"kv_transport must be one of \[None, 'object_store', "
                                         r"'rdt'\]; got 'nixl'"):
        _config(kv_role="decode", kv_transport="nixl")
    with pytest.raises(ValueError, match="has no kv_role .colocated.: remove it"):
        _config(kv_transport="rdt")


def test_the_default_is_the_object_store_on_cpu_and_rdt_on_cuda_where_it_runs() -> None:
    assert resolve_kv_transport(_config(kv_role="decode", executor="ray"), "cpu") == \
        "object_store"
    assert resolve_kv_transport(_config(kv_role="decode", tensor_parallel_size=2), "cuda") == \
        ("rdt" if _CUPY else "object_store")
    # an in-process tp 1 replica has no actor to send from
    assert resolve_kv_transport(_config(kv_role="decode"), "cuda") == "object_store"
    assert resolve_kv_transport(_config(kv_role="prefill", kv_transport="object_store",
                                        tensor_parallel_size=2), "cuda") == "object_store"


def test_rdt_on_cpu_is_gloo_between_tp1_ray_ranks() -> None:
    assert resolve_kv_transport(_config(kv_role="decode", executor="ray",
                                        kv_transport="rdt"), "cpu") == "rdt"
    with pytest.raises(ValueError, match="set executor 'ray'"):
        resolve_kv_transport(_config(kv_role="decode", kv_transport="rdt"), "cpu")
    with pytest.raises(ValueError, match="tensor_parallel_size 2 rank has one already"):
        resolve_kv_transport(_config(kv_role="prefill", kv_transport="rdt",
                                     tensor_parallel_size=2), "cpu")


@pytest.mark.skipif(_CUPY, reason="checks the refusal where cupy is missing; it is installed")
def test_rdt_on_cuda_without_cupy_says_what_to_install() -> None:
    with pytest.raises(ValueError, match="pip install cupy-cuda12x"):
        resolve_kv_transport(_config(kv_role="decode", kv_transport="rdt",
                                     tensor_parallel_size=2), "cuda")


def test_a_stashed_payload_is_taken_once_or_dropped_after_its_bound() -> None:
    stash = PayloadStash()
    a, b = torch.arange(6.0), torch.ones(2)
    stash.put("a", a, ttl_s=30.0)
    stash.put("b", b, ttl_s=0.05)
    assert stash.has("a") and stash.has("b") and len(stash) == 2
    assert torch.equal(stash.take("a"), a)
    assert not stash.has("a")
    with pytest.raises(KVTransferError, match="KV payload a is gone"):
        stash.take("a")
    time.sleep(0.1)
    assert not stash.has("b") and len(stash) == 0  # its bound passed: dropped


def test_an_rdt_handle_is_ready_at_once() -> None:
    """(Its pull finds the payload or its absence: the engine does not wait out the bound.)"""
    assert ready([RDTHandle(actor=None, key="k", backend="gloo")])
