"""Safetensors loading: single file and sharded index give the same weights; clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from workers_testlib import LocalExecutor, PlanBuilder

from scheduler.sampling_params import SamplingParams
from workers.config import WorkerConfig
from workers.worker import Worker


def _copy_meta(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        shutil.copyfile(src / name, dst / name)


def _shard(src: str, dst: Path, num_files: int = 3) -> Path:
    """Split a single-file checkpoint into model-0000i-of-0000n.safetensors + index."""
    _copy_meta(Path(src), dst)
    tensors = load_file(str(Path(src) / "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    for i in range(num_files):
        fname = f"model-{i + 1:05d}-of-{num_files:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::num_files]}
        save_file(part, str(dst / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return dst


def _loaded(model_dir: str, **kw) -> Worker:
    kw.setdefault("max_model_len", 512)
    w = Worker(WorkerConfig(model=model_dir, **kw))
    w.init_distributed()
    w.load_model()
    return w


def test_sharded_checkpoint_loads_the_same_weights(second_dir: str, tmp_path: Path) -> None:
    sharded = _shard(second_dir, tmp_path / "sharded")
    a = _loaded(second_dir).model.state_dict()
    b = _loaded(str(sharded)).model.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    full = load_file(str(Path(second_dir) / "model.safetensors"))
    qkv = a["model.layers.1.self_attn.qkv_proj.weight"]
    assert torch.equal(qkv, torch.cat([full[f"model.layers.1.self_attn.{p}_proj.weight"]
                                       for p in "qkv"]))
    assert torch.equal(a["lm_head.weight"], full["lm_head.weight"])  # untied


def test_missing_shard_file_is_a_value_error(second_dir: str, tmp_path: Path) -> None:
    sharded = _shard(second_dir, tmp_path / "sharded")
    (sharded / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ValueError, match="do not exist"):
        _loaded(str(sharded))


def test_missing_tensor_is_a_value_error(second_dir: str, tmp_path: Path) -> None:
    dst = tmp_path / "partial"
    _copy_meta(Path(second_dir), dst)
    tensors = load_file(str(Path(second_dir) / "model.safetensors"))
    del tensors["model.layers.2.mlp.up_proj.weight"]
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(ValueError, match="layers.2.mlp.gate_up_proj"):
        _loaded(str(dst))


def test_no_weights_is_a_value_error(second_dir: str, tmp_path: Path) -> None:
    _copy_meta(Path(second_dir), tmp_path / "empty")
    with pytest.raises(ValueError, match="no model.safetensors"):
        _loaded(str(tmp_path / "empty"))


def test_max_model_len_beyond_positions_is_a_value_error(second_dir: str) -> None:
    with pytest.raises(ValueError, match="max_model_len 1024 exceeds .*max_position_embeddings 512"):
        _loaded(second_dir, max_model_len=1024)


def test_bfloat16_on_cpu_runs(second_dir: str) -> None:
    ex = LocalExecutor(model=second_dir, dtype="bfloat16", max_model_len=512, num_gpu_blocks=16)
    try:
        w = ex.worker
        assert {p.dtype for p in w.model.parameters()} == {torch.bfloat16}
        assert w.cache_engine.gpu_cache.dtype == torch.bfloat16
        builder = PlanBuilder(num_gpu_blocks=16)
        sid = builder.add(list(range(3, 30)), SamplingParams(temperature=0), max_tokens=4)
        out = builder.run(ex)[sid]
        assert len(out) == 4 and all(0 <= t < 1003 for t in out)
        assert np.isfinite(np.stack(builder.seqs[sid].logits)).all()
    finally:
        ex.close()


def test_cpu_block_counts(second_dir: str) -> None:
    w = _loaded(second_dir, max_model_len=512, max_num_seqs=4, swap_space=0.5)
    block_bytes = 2 * 3 * 16 * 4 * 16 * 4  # K+V, layers, block, kv heads, head_dim, fp32
    assert w.kv_block_bytes() == block_bytes
    assert w.determine_num_blocks() == (4 * 32, (1 << 29) // block_bytes, 0)  # no offload tier
    w2 = _loaded(second_dir, max_model_len=512, num_gpu_blocks_override=7, swap_space=0)
    assert w2.determine_num_blocks() == (7, 0, 0)
    w3 = _loaded(second_dir, max_model_len=512, num_gpu_blocks_override=7, swap_space=0,
                 kv_offloading_size=0.25)  # GiB for the replica; one rank here
    assert w3.determine_num_blocks() == (7, 0, (1 << 28) // block_bytes)
