"""Session-wide test settings: offline Hugging Face, one model cache, Triton's interpreter on CPU,
one Ray temp dir per pytest-xdist worker, a gpu test's device memory returned after it."""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Before anything imports transformers or defines a Triton kernel.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("QWEN3_SERVE_CACHE", str(Path.home() / ".cache" / "qwen3-serve"))

# Under pytest-xdist (`./dev test`: two workers) each worker is a test session of its own
# with its own Ray clusters. Ray keeps "the cluster to join" in $RAY_TMPDIR/ray/
# ray_current_cluster (a simulated multi-node cluster writes it; `ray.init()` and `serve run`
# with no address read it): a temp dir per worker and run keeps one worker's bare `ray.init()`
# from ever joining the other's cluster. Ray's sockets live under it, hence a short path.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["RAY_TMPDIR"] = os.path.join(
        os.environ.get("RAY_TMPDIR", "/tmp"),
        f"ray-{os.environ.get('PYTEST_XDIST_TESTRUNUID', '')[:8]}-{os.environ['PYTEST_XDIST_WORKER']}")
    os.makedirs(os.environ["RAY_TMPDIR"], exist_ok=True)

import pytest  # noqa: E402
import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Triton kernels run on CPU tensors only under the interpreter; it must be set before
    # any @triton.jit function is defined, hence here, at the top of the first conftest.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With PYTEST_FAILURE_LOG set, each failure's traceback is appended to that file as it
    happens (under xdist too, where the controller writes it: a worker's reports reach it) - a
    run cut off by its time budget (the GPU report's) still says why each failed test failed."""
    path = os.environ.get("PYTEST_FAILURE_LOG")
    if path and report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(path, "a") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


# Test files that run on one xdist worker, one after another, as if they were one file: each
# starts a simulated multi-node cluster (a head and up to four raylets), and two at once on a
# 2-core host, beside the other worker's tests, overloaded the GCS on CI (a node not registered
# within Ray's fixed 30 s).
ONE_WORKER_DIRS = ("tests/cluster/multinode/",)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under `--dist loadfile` (`./dev test`), the files of each of `ONE_WORKER_DIRS` are one
    unit of work (one worker, in order); every other file is its own unit, as loadfile has it."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class OneWorkerDirs(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return next((d for d in ONE_WORKER_DIRS if scope.startswith(d)), scope)

    return OneWorkerDirs(config, log)


# The GPU report (bench/gpu_report.py) runs the gpu tests on six xdist workers sharing one GPU,
# so a gpu test that builds an engine or a worker on CUDA names its KV cache's size
# (`num_gpu_blocks_override`, `num_gpu_blocks`, or a `gpu_memory_utilization` of at most 0.1;
# the engine's default, 0.9, took 69 GiB of an H100 for qwen3-tiny and every other worker's
# tests ran out of memory) and shuts it down in a `finally` or a fixture's teardown
# (tests/test_gpu_report.py checks the first where it can read it).


@pytest.fixture(autouse=True)
def _gpu_test_leaves_the_device_free(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a gpu test, what it allocated goes back to the device, for the other test workers
    sharing it: a failed test's error, which pytest keeps in `sys.last_traceback` (and with it
    every frame's locals: the engine the test was building) until the next failure, is
    dropped; cycles are collected (an engine raises the collector's threshold, so they wait);
    the caching allocator's free blocks are returned (another process cannot use them)."""
    yield
    if request.node.get_closest_marker("gpu") is None or not torch.cuda.is_initialized():
        return
    for name in ("last_exc", "last_type", "last_value", "last_traceback"):
        vars(sys).pop(name, None)
    gc.collect()
    torch.cuda.empty_cache()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Tokenizers loaded by a plain AutoTokenizer.from_pretrained(directory), by (directory, files'
# mtimes).
_TOKENIZERS: dict[tuple, Any] = {}


def _tokenizer_key(path: Any, args: tuple, kwargs: dict) -> tuple | None:
    """The cache key of a plain `from_pretrained(directory)` call (the engine's), or None (not
    cached): any other argument is a caller's own tokenizer (sentence-transformers loads one
    through AutoProcessor with its options and sets attributes on it)."""
    directory = Path(str(path))
    if args or kwargs or not directory.is_dir():
        return None
    stamps = tuple(sorted((f.name, f.stat().st_mtime_ns) for f in directory.iterdir()))
    return (str(directory.resolve()), stamps)


@pytest.fixture(autouse=True)
def _one_tokenizer_per_checkpoint() -> Iterator[None]:
    """A plain AutoTokenizer.from_pretrained(directory), the engine's call, loads each
    checkpoint's tokenizer once per test session: transformers 5 rebuilds Qwen3's BPE from its
    151k-entry vocabulary and merges on every load (half of an in-process qwen3-tiny engine's
    start-up here, its objects walked again by the start-up `gc.collect`), and the suite
    builds hundreds of in-process engines on a few checkpoints. The engine and the tests only
    read a tokenizer (none sets an attribute on one; a test that monkeypatches a method gets
    it back at teardown), so one object per checkpoint serves them all; the first load of each
    is the real one. A directory whose files change (a test writing its own) is a new key; a
    call with any other argument is not cached. Installed once transformers is imported, so a
    session that never imports it never pays for it. Ray actors and subprocesses load their
    own, as in production."""
    transformers = sys.modules.get("transformers")
    auto = getattr(transformers, "AutoTokenizer", None) if transformers else None
    if auto is not None and not getattr(auto.from_pretrained, "_session_cache", False):
        load = auto.from_pretrained.__func__

        def from_pretrained(cls: type, path: Any, *args: Any, **kwargs: Any) -> Any:
            key = _tokenizer_key(path, args, kwargs)
            if key is None:
                return load(cls, path, *args, **kwargs)
            if key not in _TOKENIZERS:
                _TOKENIZERS[key] = load(cls, path, *args, **kwargs)
            return _TOKENIZERS[key]

        from_pretrained._session_cache = True  # type: ignore[attr-defined]
        auto.from_pretrained = classmethod(from_pretrained)
    yield


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    """The embedded qwen3-tiny checkpoint directory (written on first use)."""
    from workers.tiny_model import resolve_model

    return resolve_model("qwen3-tiny")


@pytest.fixture(scope="session")
def rerank_card_scores() -> Any:
    """Qwen3-Reranker's model-card reference computation, as a function of (checkpoint dir,
    [(query, document)]): prefix + the formatted pair + suffix tokens, transformers'
    AutoModelForCausalLM in fp32, the last position's "yes" and "no" logits, log-softmax, exp
    of "yes". The oracle of the pooling runner's scores (offline and over HTTP)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cluster.engine.pooling import RERANK_INSTRUCTION, RERANK_PREFIX, RERANK_SUFFIX

    def scores(path: str, pairs: list[tuple[str, str]],
               instruction: str = RERANK_INSTRUCTION, keep_last: int | None = None
               ) -> list[float]:
        """(`keep_last`: each prompt's last that many tokens, vLLM's truncate_prompt_tokens)"""
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
        prefix = tok.encode(RERANK_PREFIX, add_special_tokens=False)
        suffix = tok.encode(RERANK_SUFFIX, add_special_tokens=False)
        out = []
        for query, doc in pairs:
            text = f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}"
            ids = prefix + tok(text)["input_ids"] + suffix
            ids = ids[-keep_last:] if keep_last else ids
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1]
            pair = torch.stack([logits[no], logits[yes]]).log_softmax(-1)
            out.append(float(pair[1].exp()))
        return out

    return scores
