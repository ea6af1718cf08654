"""Prefill/decode disaggregation over Ray Direct Transport with NCCL (`kv_transport: rdt` on
CUDA): a tp 1 prefill engine's payload stays on its GPU and reaches the decode engine's GPU
over a NCCL pair, and the outputs equal one colocated engine's (greedy, fp32). Needs CUDA, Ray,
cupy (Ray's NCCL groups run on it) and two GPUs (a Ray rank takes a whole one)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (RDT over NCCL)", allow_module_level=True)
for _module, _why in (("ray", "the engines' ranks are Ray actors"),
                      ("cupy", "Ray's NCCL collective groups run on cupy")):
    if importlib.util.find_spec(_module) is None:
        pytest.skip(f"needs {_module} on the GPU machine: {_why}", allow_module_level=True)

from pd_testlib import assert_no_block_held, colocated, decode, prefill  # noqa: E402

from cluster.engine.config import EngineConfig  # noqa: E402
from cluster.engine.llm_engine import LLMEngine  # noqa: E402
from cluster.engine.rdt_transport import RDTHandle  # noqa: E402
from scheduler import SamplingParams  # noqa: E402

PROMPT = [(i * 104729) % 150000 + 100 for i in range(53)]


@pytest.fixture(scope="module")
def engines(tiny_model_path: str) -> Iterator[tuple]:
    import os

    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    started = not ray.is_initialized()
    if started:
        ray.init("local", include_dashboard=False, log_to_driver=False)
    if ray.cluster_resources().get("GPU", 0) < 2:
        pytest.skip("needs 2 GPUs: the prefill and the decode engine's Ray ranks take one each")
    common = dict(model="qwen3-tiny", device="cuda", dtype="float32", executor="ray",
                  max_num_seqs=4, gpu_memory_utilization=0.2, enforce_eager=True)
    made = [LLMEngine(EngineConfig(kv_role="prefill", kv_transport="rdt", **common)),
            LLMEngine(EngineConfig(kv_role="decode", kv_transport="rdt", **common)),
            LLMEngine(EngineConfig(**common))]
    yield tuple(made)
    for e in made:
        e.shutdown()
    if started:
        ray.shutdown()


def test_rdt_nccl_outputs_equal_colocated(engines: tuple) -> None:
    p, d, c = engines
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = colocated(c, "c", PROMPT, params)
    transfer = prefill(p, "pd", PROMPT, params)
    assert [type(h) for h in transfer.payloads] == [RDTHandle]
    assert transfer.payloads[0].backend == "nccl"
    assert decode(d, "pd", PROMPT, params, transfer) == want
    m = d.metrics()
    assert m["kv_transfer_imports_total"] == 1 and m["kv_transfer_fallbacks_total"] == 0
    assert m["kv_transfer_bytes_in_total"] == transfer.nbytes > 0
    for e in (p, d):
        assert_no_block_held(e)
