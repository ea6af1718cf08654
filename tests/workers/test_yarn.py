"""YaRN: rope_type yarn read from config.json (both spellings) or set by `hf_overrides`, and
greedy tokens and logits equal to transformers' (fp32, CPU) at tp 1 and tp 2 on a model whose
original context (32) every prompt passes; the length limit is factor x original."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from transformers import Qwen3Config
from workers_testlib import SINGLE_KV_CONFIG, LocalExecutor, PlanBuilder, hf_greedy

from scheduler.sampling_params import SamplingParams
from workers.model_config import YarnScaling, load_model_config
from workers.tiny_model import write_random_qwen3

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
PLAIN_CONFIG = dict(SINGLE_KV_CONFIG, max_position_embeddings=32)
YARN_CONFIG = dict(PLAIN_CONFIG, max_position_embeddings=128,
                   rope_parameters={"rope_theta": SINGLE_KV_CONFIG["rope_theta"], **YARN})
PROMPT_LENS = (40, 75, 100)  # all past the original context of 32
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def yarn_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_random_qwen3(tmp_path_factory.mktemp("yarn") / "y", YARN_CONFIG, seed=4))


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The same weights (same seed and shapes) with plain RoPE and a 32-token context."""
    return str(write_random_qwen3(tmp_path_factory.mktemp("yarn") / "p", PLAIN_CONFIG, seed=4))


@pytest.fixture(scope="module")
def yarn_oracle(yarn_dir: str) -> tuple[list[list[int]], list]:
    rng = np.random.default_rng(99)
    prompts = [rng.integers(10, SINGLE_KV_CONFIG["vocab_size"], n).tolist() for n in PROMPT_LENS]
    return prompts, hf_greedy(yarn_dir, prompts, NEW_TOKENS)


def _check_parity(executor, prompts: list[list[int]], reference: list) -> None:
    builder = PlanBuilder(block_size=16, num_gpu_blocks=64, token_budget=48)
    ids = [builder.add(p, SamplingParams(temperature=0), max_tokens=NEW_TOKENS) for p in prompts]
    outputs = builder.run(executor)
    for sid, (ref_tokens, ref_logits) in zip(ids, reference):
        assert outputs[sid] == ref_tokens
        np.testing.assert_allclose(np.stack(builder.seqs[sid].logits), np.stack(ref_logits),
                                   atol=1e-4, rtol=0)


def test_yarn_from_rope_parameters_and_legacy_rope_scaling(yarn_dir: str, tmp_path: Path) -> None:
    cfg = load_model_config(yarn_dir)
    assert cfg.yarn == YarnScaling(factor=4.0, original_max_position_embeddings=32)
    assert cfg.max_context_len == 128
    # Qwen3's model card spelling (transformers 4): rope_scaling with `type`, theta on top.
    raw = json.loads((Path(yarn_dir) / "config.json").read_text())
    del raw["rope_parameters"]
    raw.update(rope_theta=10000.0, max_position_embeddings=40960, rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = load_model_config(tmp_path)
    assert (cfg.yarn.factor, cfg.max_context_len, cfg.rope_theta) == (4.0, 131072, 10000.0)


def test_yarn_saved_by_transformers(tmp_path: Path) -> None:
    Qwen3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                num_hidden_layers=1, intermediate_size=48, vocab_size=64,
                max_position_embeddings=64, rope_parameters={
                    "rope_type": "yarn", "rope_theta": 5e5, "factor": 2.0,
                    "beta_fast": 16.0, "attention_factor": 0.8}).save_pretrained(tmp_path)
    cfg = load_model_config(tmp_path)
    # original_max_position_embeddings left out: transformers takes max_position_embeddings
    assert cfg.yarn == YarnScaling(factor=2.0, original_max_position_embeddings=64,
                                   beta_fast=16.0, attention_factor=0.8)
    assert (cfg.rope_theta, cfg.max_context_len) == (5e5, 128)


def test_hf_overrides_set_yarn_and_keep_the_checkpoint_theta(plain_dir: str) -> None:
    cfg = load_model_config(plain_dir, hf_overrides={"rope_scaling": YARN})
    assert cfg.yarn == YarnScaling(factor=4.0, original_max_position_embeddings=32)
    assert cfg.rope_theta == SINGLE_KV_CONFIG["rope_theta"] and cfg.max_context_len == 128
    assert load_model_config(plain_dir, hf_overrides={"rope_parameters": YARN}) == cfg


@pytest.mark.parametrize(("overrides", "message"), [
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
     r"rope_type 'linear' \(rope_parameters / rope_scaling\); supported: \['default', 'yarn'\]"),
    ({"rope_scaling": {"rope_type": "yarn"}}, r"rope_type 'yarn' needs rope_parameters.factor"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 0.5}}, r"factor must be a number >= 1"),
    ({"rope_scalling": YARN}, r"hf_overrides sets \['rope_scalling'\], which this loader does "
                              r"not read; valid keys: \[.*'rope_scaling'"),
    (["rope_scaling"], r"hf_overrides must be a mapping"),
])
def test_bad_yarn_settings_are_refused(plain_dir: str, overrides, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_model_config(plain_dir, hf_overrides=overrides)


def test_max_model_len_limits_name_their_source(plain_dir: str) -> None:
    plain = load_model_config(plain_dir)
    plain.check_max_model_len(32)
    with pytest.raises(ValueError, match=r"max_model_len 33 exceeds .*max_position_embeddings 32"
                                         r".*extend the context with YaRN"):
        plain.check_max_model_len(33)
    yarn = load_model_config(plain_dir, hf_overrides={"rope_scaling": YARN})
    yarn.check_max_model_len(128)
    with pytest.raises(ValueError, match=r"max_model_len 129 exceeds what .*YaRN allows: factor "
                                         r"4.0 x original_max_position_embeddings 32 = 128"):
        yarn.check_max_model_len(129)


def test_plain_rope_differs_past_the_original_context(plain_dir: str, yarn_oracle) -> None:
    """The parity below is not vacuous: the same weights with plain RoPE answer differently."""
    prompts, reference = yarn_oracle
    plain = hf_greedy(plain_dir, prompts[:1], 1)
    assert not np.allclose(plain[0][1][0], reference[0][1][0], atol=1e-2)


def test_tp1_yarn_matches_transformers(yarn_dir: str, yarn_oracle) -> None:
    executor = LocalExecutor(model=yarn_dir, num_gpu_blocks=64, max_model_len=128)
    try:
        _check_parity(executor, *yarn_oracle)
    finally:
        executor.close()


def test_tp1_yarn_by_hf_overrides_matches_transformers(plain_dir: str, yarn_oracle) -> None:
    executor = LocalExecutor(model=plain_dir, num_gpu_blocks=64, max_model_len=128,
                             hf_overrides={"rope_scaling": YARN})
    try:
        _check_parity(executor, *yarn_oracle)
    finally:
        executor.close()


def test_tp2_yarn_matches_transformers(yarn_dir: str, yarn_oracle, tp2_group) -> None:
    tp2_group.init(model=yarn_dir, num_gpu_blocks=64, max_model_len=128,
                   num_gpu_blocks_override=64, swap_space=0.001)
    try:
        _check_parity(tp2_group, *yarn_oracle)
    finally:
        tp2_group.shutdown_workers()


def test_tp2_yarn_by_hf_overrides_matches_transformers(plain_dir: str, yarn_oracle,
                                                      tp2_group) -> None:
    tp2_group.init(model=plain_dir, num_gpu_blocks=64, max_model_len=128,
                   num_gpu_blocks_override=64, swap_space=0.001,
                   hf_overrides={"rope_scaling": YARN})
    try:
        _check_parity(tp2_group, *yarn_oracle)
    finally:
        tp2_group.shutdown_workers()
