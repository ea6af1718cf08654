"""Fixtures of the HTTP layer's tests: the qwen3-tiny tokenizer and a fresh fake engine
(fake_engine.py) per test."""

from __future__ import annotations

from typing import Any

import pytest
from fake_engine import FakeEngine


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture
def engine(tokenizer: Any) -> FakeEngine:
    return FakeEngine(tokenizer)
