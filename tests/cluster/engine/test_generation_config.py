"""Sampling defaults from the model's generation_config.json (EngineConfig.generation_config):
"auto" gives a request what the checkpoint recommends for the settings it leaves out, as vLLM
does by default; "vllm" ignores them; a file SamplingParams would refuse fails at start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster import LLM, SamplingParams
from cluster.engine.config import EngineConfig
from cluster.engine.engine_setup import default_sampling
from workers.model_config import load_generation_defaults

# Qwen3's generation_config.json, as its checkpoints ship it.
QWEN3_GENERATION = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
                    "pad_token_id": 151643, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
                    "transformers_version": "4.51.0"}


def checkpoint_with(tiny_model_path: str, tmp_path: Path, generation: dict) -> str:
    """qwen3-tiny's files (linked) with this generation_config.json."""
    for f in Path(tiny_model_path).iterdir():
        if f.name != "generation_config.json":
            (tmp_path / f.name).symlink_to(f)
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return str(tmp_path)


def test_the_recommended_sampling_settings_are_read(tiny_model_path: str, tmp_path: Path) -> None:
    path = checkpoint_with(tiny_model_path, tmp_path, {**QWEN3_GENERATION, "min_p": 0,
                                                       "repetition_penalty": 1.05})
    want = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
            "repetition_penalty": 1.05}
    assert load_generation_defaults(path) == want
    assert isinstance(load_generation_defaults(path)["top_k"], int)
    assert default_sampling(path, "auto") == want
    assert default_sampling(path, "vllm") == {}
    # qwen3-tiny's own file recommends nothing (do_sample false, ids only)
    assert default_sampling(tiny_model_path, "auto") == {}


def test_a_file_sampling_params_refuses_fails_at_start(tiny_model_path: str,
                                                       tmp_path: Path) -> None:
    path = checkpoint_with(tiny_model_path, tmp_path, {**QWEN3_GENERATION, "top_p": 1.5})
    with pytest.raises(ValueError, match=r"generation_config.json recommends .*top_p.*"
                                         r"generation_config: vllm"):
        default_sampling(path, "auto")
    assert default_sampling(path, "vllm") == {}


def test_generation_config_takes_auto_or_vllm() -> None:
    with pytest.raises(ValueError, match=r"generation_config must be one of \['auto', 'vllm'\]"):
        EngineConfig(generation_config="hf")


def test_offline_llm_uses_them_when_given_no_sampling_params(tiny_model_path: str,
                                                             tmp_path: Path) -> None:
    """The first request of a fresh LLM with the same engine seed draws from the same stream,
    so the defaults give the tokens those settings give, and plain SamplingParams() others."""
    path = checkpoint_with(tiny_model_path, tmp_path, QWEN3_GENERATION)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}

    def first_tokens(params: SamplingParams | None, generation_config: str = "auto") -> list:
        with LLM(path, executor="inprocess", seed=7,
                 generation_config=generation_config) as llm:
            if params is None:
                defaults = llm.get_default_sampling_params()
                assert (defaults.temperature, defaults.top_p, defaults.top_k) == (
                    (0.6, 0.95, 20) if generation_config == "auto" else (1.0, 1.0, 0))
            out = llm.generate([prompt], params, use_tqdm=False)
        return out[0].outputs[0].token_ids

    implicit = first_tokens(None)
    assert implicit == first_tokens(SamplingParams(temperature=0.6, top_p=0.95, top_k=20))
    assert first_tokens(None, "vllm") == first_tokens(SamplingParams())
    assert implicit != first_tokens(SamplingParams())
