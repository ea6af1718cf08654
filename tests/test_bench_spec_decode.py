"""bench/spec_decode.py's `draft` row: the draft it picks must share the target's KV layout
(its layers use the target's cache blocks), for the tiny target on CPU and for the GPU
report's Qwen3-0.6B-shaped one, and a draft it had to write is reused by the next run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from spec_decode import draft_model  # noqa: E402

from workers.draft_runner import check_draft_fits  # noqa: E402
from workers.model_config import load_model_config  # noqa: E402
from workers.tiny_model import (  # noqa: E402
    QWEN3_0_6B_CONFIG,
    TINY_DRAFT_MODEL_NAME,
    qwen3_config_dict,
    resolve_model,
)


def test_the_tiny_target_gets_qwen3_tiny_draft() -> None:
    assert draft_model("qwen3-tiny") == resolve_model(TINY_DRAFT_MODEL_NAME)


def test_a_06b_shaped_target_gets_a_two_layer_draft_of_its_kv_layout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU report's target (8 KV heads of dim 128), from its config.json alone."""
    monkeypatch.setenv("QWEN3_SERVE_CACHE", str(tmp_path / "cache"))
    target = tmp_path / "qwen3-0.6b-random"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(qwen3_config_dict(QWEN3_0_6B_CONFIG)))
    path = draft_model(str(target))
    assert Path(path).parent == tmp_path / "cache"
    want, draft = load_model_config(target), load_model_config(path)
    check_draft_fits(want, draft, 1)
    assert (draft.num_hidden_layers, draft.num_key_value_heads, draft.head_dim) == (2, 8, 128)
    weights = Path(path) / "model.safetensors"
    written = weights.stat().st_mtime_ns
    assert draft_model(str(target)) == path  # the next run reuses it
    assert weights.stat().st_mtime_ns == written
