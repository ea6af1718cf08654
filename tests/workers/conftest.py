"""Fixtures shared by the workers tests: checkpoints, the HF oracle, a reusable TP=2 group."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from workers_testlib import (  # noqa: E402
    NUM_GREEDY_TOKENS,
    SECOND_CONFIG,
    SINGLE_KV_CONFIG,
    ProcessGroupExecutor,
    hf_greedy,
    parity_prompts,
)

from workers.tiny_model import resolve_model, write_random_qwen3  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir() -> str:
    return resolve_model("qwen3-tiny")


@pytest.fixture(scope="session")
def second_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_random_qwen3(tmp_path_factory.mktemp("ckpt") / "second", SECOND_CONFIG, 7))


@pytest.fixture(scope="session")
def single_kv_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_random_qwen3(tmp_path_factory.mktemp("ckpt") / "single_kv",
                                  SINGLE_KV_CONFIG, 11))


@pytest.fixture(scope="session")
def model_dirs(tiny_dir: str, second_dir: str, single_kv_dir: str) -> dict[str, str]:
    return {"tiny": tiny_dir, "second": second_dir, "single_kv": single_kv_dir}


_VOCAB = {"tiny": 151936, "second": SECOND_CONFIG["vocab_size"],
          "single_kv": SINGLE_KV_CONFIG["vocab_size"]}


@pytest.fixture(scope="session")
def oracle(model_dirs: dict[str, str]):
    """oracle(name) -> (prompts, [(greedy tokens, logits per token)]) from transformers, cached."""
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            prompts = parity_prompts(_VOCAB[name])
            cache[name] = (prompts, hf_greedy(model_dirs[name], prompts, NUM_GREEDY_TOKENS))
        return cache[name]

    return get


@pytest.fixture(scope="session")
def tp2_group():
    """Two spawned gloo ranks, reused by every TP test of the session."""
    group = ProcessGroupExecutor(world_size=2)
    yield group
    group.close()


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """The tiny models' ops take microseconds: on a 2-core CI host shared with spawned TP
    ranks, a second intra-op thread only adds spin-waiting (measured 5x slower steps)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
