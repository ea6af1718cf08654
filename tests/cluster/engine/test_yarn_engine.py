"""YaRN through the engine: `hf_overrides` (vLLM's key, also a manifest arg) give qwen3-tiny a
16-token original context stretched 4x; max_model_len defaults to and stops at factor x
original, and greedy tokens past the original context equal transformers' on the same config."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from cluster import LLM, SamplingParams
from cluster.engine.config import EngineConfig
from cluster.engine.llm_engine import LLMEngine

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
MAX_NEW = 10


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    shared = [rng.randrange(100, 150000) for _ in range(20)]
    return [shared + [rng.randrange(100, 150000) for _ in range(k)] for k in (3, 14, 30)]


@pytest.fixture(scope="module")
def yarn_oracle(tiny_model_path: str, tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    """transformers' greedy tokens for qwen3-tiny with YARN written into its config.json."""
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("tiny_yarn")
    for f in Path(tiny_model_path).iterdir():
        (path / f.name).symlink_to(f)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").unlink()
    raw["rope_parameters"] = {**raw["rope_parameters"], **YARN}
    (path / "config.json").write_text(json.dumps(raw))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False)
                [0, len(p):].tolist() for p in _prompts()]


def test_greedy_past_the_original_context_matches_transformers(yarn_oracle) -> None:
    with LLM("qwen3-tiny", device="cpu", max_num_seqs=4, max_num_batched_tokens=64,
             hf_overrides={"rope_scaling": YARN}) as llm:
        assert llm.engine.max_model_len == 64  # factor 4 x original 16, by default
        outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()],
                            SamplingParams(temperature=0.0, max_tokens=MAX_NEW), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == yarn_oracle
        assert llm.engine.scheduler.kv.stats().prefix_hits >= 16  # the shared 20-token prefix


def test_max_model_len_past_factor_times_original_is_refused() -> None:
    with pytest.raises(ValueError, match=r"max_model_len 65 exceeds what .*YaRN allows: factor "
                                         r"4.0 x original_max_position_embeddings 16 = 64"):
        LLMEngine(EngineConfig(device="cpu", max_model_len=65, hf_overrides={"rope_scaling": YARN}))


def test_max_model_len_past_the_checkpoint_names_yarn() -> None:
    with pytest.raises(ValueError, match=r"max_model_len 4097 exceeds .*max_position_embeddings "
                                         r"4096; lower max_model_len, or extend the context "
                                         r"with YaRN \(hf_overrides"):
        LLMEngine(EngineConfig(device="cpu", max_model_len=4097))


def test_hf_overrides_must_be_a_mapping() -> None:
    with pytest.raises(ValueError, match="hf_overrides must be a mapping of config.json keys"):
        EngineConfig.from_dict({"hf_overrides": "rope_scaling=yarn"})


def test_manifest_args_carry_hf_overrides_to_the_engine_config() -> None:
    from cluster.api.serve_app import split_args

    config, _ = split_args({"hf_overrides": {"rope_scaling": YARN}, "max_model_len": 64})
    assert config.hf_overrides == {"rope_scaling": YARN} and config.max_model_len == 64
