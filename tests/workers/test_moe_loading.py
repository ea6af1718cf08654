"""Qwen3-MoE checkpoints: config parsing (which layers are sparse), the experts' stacked
parameters filled from the hub layout (TP slices, EP whole experts), and the errors a user
gets for a missing or misshapen expert tensor, an expert count EP cannot split, and
weights that do not fit the device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from moe_testlib import MOE_ALL_SPARSE, MOE_MIXED
from safetensors.torch import load_file, save_file

from workers.distributed import TensorParallelGroup
from workers.layers import FusedMoE
from workers.loader import load_model
from workers.model_config import load_model_config
from workers.qwen3 import Qwen3ForCausalLM
from workers.tiny_model import (
    QWEN3_30B_A3B_CONFIG,
    TINY_MOE_MODEL_NAME,
    qwen3_config_dict,
    resolve_model,
    write_random_qwen3,
)
from workers.worker import check_weights_fit


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    return str(write_random_qwen3(tmp_path_factory.mktemp("moe") / "m", MOE_ALL_SPARSE, 5))


def _build(path: str, rank: int = 0, world_size: int = 1, ep: bool = False) -> Qwen3ForCausalLM:
    # A TP group object without a process group: construction and loading never communicate.
    tp = TensorParallelGroup(rank, world_size, None)
    model = Qwen3ForCausalLM(load_model_config(path, world_size), tp, torch.float32,
                             "torch", expert_parallel=ep)
    load_model(model, path)
    return model


def test_sparse_layers_follow_transformers_rule(tmp_path: Path) -> None:
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import (
        Qwen3MoeDecoderLayer,
        Qwen3MoeSparseMoeBlock,
    )

    for step, only in ((1, []), (2, []), (1, [0, 2]), (3, [2])):
        raw = qwen3_config_dict({**MOE_MIXED, "num_hidden_layers": 6, "decoder_sparse_step": step,
                                 "mlp_only_layers": only})
        (tmp_path / "config.json").write_text(json.dumps(raw))
        ours = load_model_config(tmp_path)
        hf_cfg = Qwen3MoeConfig(**{k: v for k, v in raw.items() if k != "architectures"})
        want = [isinstance(Qwen3MoeDecoderLayer(hf_cfg, i).mlp, Qwen3MoeSparseMoeBlock)
                for i in range(6)]
        assert [ours.is_sparse_layer(i) for i in range(6)] == want, (step, only)
    assert (ours.num_experts, ours.num_experts_per_tok, ours.moe_intermediate_size,
            ours.norm_topk_prob) == (6, 3, 24, False)


def test_embedded_moe_model_is_a_qwen3_moe_checkpoint() -> None:
    cfg = load_model_config(resolve_model(TINY_MOE_MODEL_NAME))
    assert cfg.num_experts == 8 and cfg.norm_topk_prob
    assert all(cfg.is_sparse_layer(i) for i in range(cfg.num_hidden_layers))


@pytest.mark.parametrize("rank", [0, 1])
def test_tp_slices_every_expert_and_ep_keeps_whole_experts(moe_dir: str, rank: int) -> None:
    ckpt = load_file(str(Path(moe_dir) / "model.safetensors"))
    p = "model.layers.1.mlp."
    tp = _build(moe_dir, rank, 2).model.layers[1].mlp
    ep = _build(moe_dir, rank, 2, ep=True).model.layers[1].mlp
    assert isinstance(tp, FusedMoE) and tp.w13_weight.shape == (8, 32, 64)
    assert ep.w13_weight.shape == (4, 64, 64) and ep.w2_weight.shape == (4, 64, 32)
    half = slice(16 * rank, 16 * rank + 16)
    for e in range(8):
        gate, up = ckpt[f"{p}experts.{e}.gate_proj.weight"], ckpt[f"{p}experts.{e}.up_proj.weight"]
        down = ckpt[f"{p}experts.{e}.down_proj.weight"]
        assert torch.equal(tp.w13_weight[e], torch.cat([gate[half], up[half]]))
        assert torch.equal(tp.w2_weight[e], down[:, half])
        if e // 4 == rank:
            assert torch.equal(ep.w13_weight[e % 4], torch.cat([gate, up]))
            assert torch.equal(ep.w2_weight[e % 4], down)
    assert torch.equal(tp.gate.weight, ckpt[p + "gate.weight"])


def _rewrite(src: str, dst: Path, edit) -> str:
    dst.mkdir()
    for f in Path(src).iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    w = load_file(str(Path(src) / "model.safetensors"))
    edit(w)
    save_file(w, str(dst / "model.safetensors"))
    return str(dst)


def test_missing_expert_tensor_is_named(moe_dir: str, tmp_path: Path) -> None:
    name = "model.layers.0.mlp.experts.5.up_proj.weight"
    path = _rewrite(moe_dir, tmp_path / "m", lambda w: w.pop(name))
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        _build(path)


def test_wrong_shape_expert_tensor_is_named(moe_dir: str, tmp_path: Path) -> None:
    name = "model.layers.1.mlp.experts.3.down_proj.weight"

    def edit(w):
        w[name] = torch.zeros(64, 48)

    path = _rewrite(moe_dir, tmp_path / "m", edit)
    with pytest.raises(ValueError, match=name.replace(".", r"\.") + r" has shape \(64, 48\)"):
        _build(path)


def test_expert_beyond_num_experts_is_named(moe_dir: str, tmp_path: Path) -> None:
    def edit(w):
        w["model.layers.0.mlp.experts.8.gate_proj.weight"] = torch.zeros(32, 64)

    path = _rewrite(moe_dir, tmp_path / "m", edit)
    with pytest.raises(ValueError, match=r"experts\.8\.gate_proj.*num_experts=8"):
        _build(path)


def test_expert_parallel_needs_experts_divisible_by_ranks() -> None:
    tp = TensorParallelGroup(0, 3, None)
    with pytest.raises(ValueError, match="num_experts=8 is not divisible by tensor_parallel_size=3"):
        FusedMoE(8, 2, 64, 33, True, tp, torch.float32, "torch", expert_parallel=True)
    with pytest.raises(ValueError, match="moe_intermediate_size=32 is not divisible"):
        FusedMoE(8, 2, 64, 32, True, tp, torch.float32, "torch")


def test_weights_that_do_not_fit_name_the_sizes(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(qwen3_config_dict(QWEN3_30B_A3B_CONFIG)))
    mc = load_model_config(tmp_path)
    # ~30.5 B parameters in bf16; the expert tensors are ~29 B of them.
    assert 56 < mc.weight_bytes_per_rank(1, 2) / 2**30 < 58
    # A 48 GiB GPU: one replica at tp 1 cannot hold it; tp 2 (~28.5 GiB a rank) can.
    with pytest.raises(ValueError, match=r"take 5\d\.\d GiB at tensor_parallel_size=1.*"
                                         r"48\.0 GiB \(43\.2 GiB\)"):
        check_weights_fit(mc, 1, 2, 48 * 2**30, 0.9)
    check_weights_fit(mc, 2, 2, 48 * 2**30, 0.9)


def test_moe_manifest_args_are_valid_engine_config() -> None:
    import yaml

    from cluster.api.serve_app import SERVING_DEFAULTS
    from cluster.engine.config import EngineConfig

    manifest = Path(__file__).resolve().parents[2] / "manifests" / "qwen3-30b-a3b.yaml"
    args = yaml.safe_load(manifest.read_text())["applications"][0]["args"]
    config = EngineConfig.from_dict({k: v for k, v in args.items() if k not in SERVING_DEFAULTS})
    assert config.tensor_parallel_size == 2 and config.enable_expert_parallel is False
    with pytest.raises(ValueError, match="enable_expert_parallel must be true or false"):
        EngineConfig(enable_expert_parallel="yes")
