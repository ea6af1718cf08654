"""sentence-transformers' pooling files read as vLLM reads them (workers/pooling_checkpoints.py):
the embedded qwen3-embedding-tiny's layout, each supported mode, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from workers.pooling_checkpoints import read_pooling_files
from workers.tiny_model import resolve_model


def _write(tmp_path: Path, modules: list[str], **flags: bool) -> Path:
    types = {"pool": "sentence_transformers.models.Pooling",
             "norm": "sentence_transformers.models.Normalize"}
    (tmp_path / "modules.json").write_text(json.dumps(
        [{"idx": i, "path": f"{i}_{m}", "type": types[m]} for i, m in enumerate(modules)]))
    for i, m in enumerate(modules):
        (tmp_path / f"{i}_{m}").mkdir()
        if m == "pool":
            (tmp_path / f"{i}_{m}" / "config.json").write_text(json.dumps(flags))
    return tmp_path


def test_the_embedding_toy_has_qwen3_embeddings_layout() -> None:
    path = Path(resolve_model("qwen3-embedding-tiny"))
    assert read_pooling_files(path) == {"pooling_type": "LAST", "normalize": True}
    prompts = json.loads((path / "config_sentence_transformers.json").read_text())["prompts"]
    assert prompts["query"].startswith("Instruct: ")
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "embed_tokens.weight" in names and not any(n.startswith("model.") for n in names)
    assert read_pooling_files(resolve_model("qwen3-reranker-tiny")) is None


@pytest.mark.parametrize("flag, kind", [("pooling_mode_mean_tokens", "MEAN"),
                                        ("pooling_mode_cls_token", "CLS"),
                                        ("pooling_mode_lasttoken", "LAST")])
def test_each_mode_without_normalize(tmp_path: Path, flag: str, kind: str) -> None:
    path = _write(tmp_path, ["pool"], **{flag: True})
    assert read_pooling_files(path) == {"pooling_type": kind, "normalize": False}


@pytest.mark.parametrize("flags, match", [
    ({"pooling_mode_max_tokens": True}, "pooling_mode_max_tokens"),
    ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}, "exactly one"),
    ({}, "exactly one"),
])
def test_unsupported_or_ambiguous_modes_are_refused(tmp_path: Path, flags: dict,
                                                    match: str) -> None:
    with pytest.raises(ValueError, match=match):
        read_pooling_files(_write(tmp_path, ["pool", "norm"], **flags))


def test_no_pooling_module_is_no_pooling_config(tmp_path: Path) -> None:
    assert read_pooling_files(tmp_path) is None
    assert read_pooling_files(_write(tmp_path, ["norm"])) is None
