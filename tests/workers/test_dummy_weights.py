"""`load_format: dummy` (workers/loader.py): a model directory with config.json and the
tokenizer but no safetensors runs with random weights, uniform in [-1e-3, 1e-3] and seeded by
each parameter's name: tensor-parallel ranks fill their own shards (replicated parameters
equal), pipeline stages draw the whole model's values (tied embeddings too), MoE experts are
filled, `quantization: fp8` quantizes the random float weights; "auto" on such a directory is
a ValueError that names "dummy"."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from fp8_testlib import FP8_DENSE_CONFIG, QWEN_FP8
from workers_testlib import LocalExecutor, PlanBuilder

from kernels.fp8_reference import FP8_DTYPE, quantize_weight_blocks
from scheduler.sampling_params import SamplingParams
from workers.config import WorkerConfig
from workers.distributed import TensorParallelGroup
from workers.loader import DUMMY_HIGH, load_model
from workers.model_config import load_model_config
from workers.pipeline import PipelineStage, get_pp_indices
from workers.qwen3 import Qwen3ForCausalLM
from workers.tiny_model import TINY_CONFIG, TINY_MOE_CONFIG, write_qwen3_config
from workers.worker import Worker


@pytest.fixture(scope="module")
def config_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Config-only directories (no *.safetensors): qwen3-tiny's and qwen3-moe-tiny's shapes,
    and an FP8-friendly dense shape (every quantized dim whole 128-blocks) plain and with
    Qwen's FP8 quantization_config."""
    root = tmp_path_factory.mktemp("dummy")
    dirs = {name: str(write_qwen3_config(root / name, cfg)) for name, cfg in (
        ("tiny", TINY_CONFIG), ("moe", TINY_MOE_CONFIG), ("fp8_float", FP8_DENSE_CONFIG))}
    fp8 = write_qwen3_config(root / "fp8", FP8_DENSE_CONFIG)
    cfg = json.loads((fp8 / "config.json").read_text())
    (fp8 / "config.json").write_text(json.dumps({**cfg, "quantization_config": QWEN_FP8}))
    dirs["fp8"] = str(fp8)
    assert not list(Path(root).glob("*/*.safetensors"))
    return dirs


def _worker(model: str, **kw) -> Worker:
    w = Worker(WorkerConfig(model=model, max_model_len=256, **kw))
    w.init_distributed()
    w.load_model()
    return w


def _model(path: str, tp: TensorParallelGroup, stage: PipelineStage | None = None,
           expert_parallel: bool = False) -> Qwen3ForCausalLM:
    model = Qwen3ForCausalLM(load_model_config(path, tp.world_size), tp, torch.float32,
                             expert_parallel=expert_parallel, stage=stage)
    load_model(model, path, "dummy")
    return model


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


@pytest.mark.parametrize("name", ["tiny", "moe"])
def test_every_parameter_is_uniform_in_range_and_seeded_by_its_name(config_dirs, name) -> None:
    a = _state(_worker(config_dirs[name], load_format="dummy").model)
    b = _state(_worker(config_dirs[name], load_format="dummy").model)
    assert a.keys() == b.keys()
    for n, p in a.items():
        assert p.abs().max() <= DUMMY_HIGH and p.std() > DUMMY_HIGH / 4, n
        assert torch.equal(p, b[n]), n  # the same config, the same model
    # two parameters of one shape: other values (each name seeds its own generator)
    assert not torch.equal(a["model.layers.0.self_attn.qkv_proj.weight"],
                           a["model.layers.1.self_attn.qkv_proj.weight"])
    if name == "moe":
        assert a["model.layers.0.mlp.w13_weight"].shape == (8, 2 * 64, 128)


def test_tied_embeddings_stay_tied(config_dirs) -> None:
    model = _worker(config_dirs["tiny"], load_format="dummy").model
    assert "lm_head.weight" not in _state(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize(("name", "expert_parallel"), [("tiny", False), ("moe", False),
                                                       ("moe", True)])
def test_two_ranks_fill_their_own_shards(config_dirs, name, expert_parallel) -> None:
    """Each rank holds its shard's shape, filled; replicated parameters (norms, the router)
    are the tp 1 model's, on every rank."""
    path = config_dirs[name]
    whole = _state(_model(path, TensorParallelGroup.single()))
    ranks = [_state(_model(path, TensorParallelGroup(r, 2), expert_parallel=expert_parallel))
             for r in (0, 1)]
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    for rank in ranks:
        assert rank.keys() == whole.keys()
        assert rank[qkv].shape == (whole[qkv].shape[0] // 2, 128)
        assert rank["model.embed_tokens.weight"].shape == (151936 // 2, 128)
        for n, p in rank.items():
            assert p.abs().max() <= DUMMY_HIGH and p.std() > DUMMY_HIGH / 4, n
        for n in ("model.layers.0.input_layernorm.weight",
                  "model.layers.0.self_attn.q_norm.weight", "model.norm.weight"):
            assert torch.equal(rank[n], whole[n]), n
    if name == "moe":
        w13 = "model.layers.0.mlp.w13_weight"
        assert ranks[0][w13].shape == ((4, 128, 128) if expert_parallel else (8, 64, 128))
        assert torch.equal(ranks[1]["model.layers.0.mlp.gate.weight"],
                           whole["model.layers.0.mlp.gate.weight"])


def test_pipeline_stages_draw_the_whole_models_values(config_dirs) -> None:
    """pp 2: every stage's parameters are the pp 1 model's; the last stage's own LM head is
    the embedding's table (tied embeddings)."""
    path = config_dirs["tiny"]
    whole = _state(_model(path, TensorParallelGroup.single()))
    table = whole["model.embed_tokens.weight"]
    seen = set()
    for rank in (0, 1):
        stage = PipelineStage(rank, 2, *get_pp_indices(4, rank, 2), global_rank=rank, tp_size=1)
        params = _state(_model(path, TensorParallelGroup.single(), stage))
        for n, p in params.items():
            assert torch.equal(p, table if n == "lm_head.weight" else whole[n]), n
        seen |= params.keys()
    assert seen == whole.keys() | {"lm_head.weight"}


def _generates_four_finite(ex: LocalExecutor, prompt: range = range(3, 40)) -> list[int]:
    """A greedy prompt through the executor gives 4 tokens, every logit finite: the tokens."""
    builder = PlanBuilder(num_gpu_blocks=32)
    sid = builder.add(list(prompt), SamplingParams(temperature=0), max_tokens=4)
    out = builder.run(ex)[sid]
    assert len(out) == 4
    assert np.isfinite(np.stack(builder.seqs[sid].logits)).all()
    return out


def test_dummy_model_generates_on_a_worker(config_dirs) -> None:
    ex = LocalExecutor(model=config_dirs["moe"], load_format="dummy", max_model_len=256,
                       num_gpu_blocks=32)
    try:
        out = _generates_four_finite(ex, range(100, 130))
        assert all(0 <= t < 151936 for t in out)
    finally:
        ex.close()


def test_fp8_quantization_runs_on_the_random_float_weights(config_dirs) -> None:
    """`quantization: fp8`: process_weights_after_loading quantizes the dummy float weights
    (exactly the 128x128 blocks of the float model's), and the W8A8 model generates."""
    path = config_dirs["fp8_float"]
    float_down = _worker(path, load_format="dummy").model.model.layers[1].mlp.down_proj.weight
    ex = LocalExecutor(model=path, load_format="dummy", quantization="fp8", max_model_len=256,
                       num_gpu_blocks=32)
    try:
        down = ex.worker.model.model.layers[1].mlp.down_proj
        q, scale = quantize_weight_blocks(float_down.data, (128, 128))
        assert down.weight.dtype == FP8_DTYPE and down.weight_scale_inv.shape == (2, 2)
        assert torch.equal(down.weight.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(down.weight_scale_inv, scale)
        _generates_four_finite(ex)
    finally:
        ex.close()


def test_fp8_checkpoint_config_runs_with_dummy_weights(config_dirs) -> None:
    """Qwen's FP8 quantization_config with no weights on disk: e4m3 weights and float32
    scales drawn in place (nothing to check the declaration against); "auto" needs the files."""
    path = config_dirs["fp8"]
    ex = LocalExecutor(model=path, load_format="dummy", max_model_len=256, num_gpu_blocks=32)
    try:
        qkv = ex.worker.model.model.layers[0].self_attn.qkv_proj
        assert qkv.weight.dtype == FP8_DTYPE and qkv.weight_scale_inv.dtype == torch.float32
        assert qkv.weight_scale_inv.abs().max() <= DUMMY_HIGH and qkv.weight_scale_inv.std() > 0
        _generates_four_finite(ex)
    finally:
        ex.close()
    with pytest.raises(ValueError, match="no model.safetensors"):
        load_model_config(path)


def test_auto_without_weights_is_a_value_error_naming_dummy(config_dirs) -> None:
    with pytest.raises(ValueError, match=r"no model\.safetensors .*load_format 'dummy'"):
        _worker(config_dirs["tiny"])


def test_unknown_load_format_is_a_value_error(config_dirs) -> None:
    with pytest.raises(ValueError, match=r"load_format must be one of \['auto', 'dummy'\]; "
                                         r"got 'pt'"):
        WorkerConfig(model="m", load_format="pt")
    model = Qwen3ForCausalLM(load_model_config(config_dirs["tiny"]),
                             TensorParallelGroup.single(), torch.float32)
    with pytest.raises(ValueError, match="load_format must be one of"):
        load_model(model, config_dirs["tiny"], "npcache")


def _greedy(executor) -> tuple[list[int], np.ndarray]:
    builder = PlanBuilder(num_gpu_blocks=32)
    sid = builder.add(list(range(100, 130)), SamplingParams(temperature=0), max_tokens=6)
    return builder.run(executor)[sid], np.stack(builder.seqs[sid].logits)


def test_two_stages_run_the_tp1_model_and_two_ranks_run(config_dirs, tp2_group) -> None:
    """Over gloo: pp 2 gives the tp 1 dummy model's tokens and logits (the same values,
    the last stage's LM head the embedding's); tp 2 generates (its shards repeat each
    other, so it is another model) and does so again after a restart."""
    path = config_dirs["tiny"]
    ex = LocalExecutor(model=path, load_format="dummy", max_model_len=256, num_gpu_blocks=32)
    try:
        want_tokens, want_logits = _greedy(ex)
    finally:
        ex.close()
    runs = {}
    for pp in (2, 1, 1):
        tp2_group.init(model=path, load_format="dummy", max_model_len=256, num_gpu_blocks=32,
                       num_gpu_blocks_override=32, swap_space=0.001, pipeline_parallel_size=pp)
        try:
            runs.setdefault(pp, []).append(_greedy(tp2_group))
        finally:
            tp2_group.shutdown_workers()
    (tokens, logits), = runs[2]
    assert tokens == want_tokens
    np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=0)
    (a, a_logits), (b, b_logits) = runs[1]
    assert a == b and np.isfinite(a_logits).all()
    np.testing.assert_array_equal(a_logits, b_logits)
