"""The engine's `load_format` (vLLM's key): "dummy" serves a directory of config.json and
tokenizer files alone with random weights (workers/loader.py), the same tokens from every
engine; "auto" on such a directory, and an unknown value, are ValueErrors at start that name
the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster import LLM, SamplingParams
from cluster.engine.config import EngineConfig
from workers.tiny_model import TINY_CONFIG, write_qwen3_config


@pytest.fixture(scope="module")
def config_only(tmp_path_factory: pytest.TempPathFactory) -> str:
    """qwen3-tiny's config.json and the Qwen3 tokenizer, no weights."""
    path = write_qwen3_config(tmp_path_factory.mktemp("dummy") / "qwen3-tiny-shapes", TINY_CONFIG)
    assert not list(Path(path).glob("*.safetensors"))
    return str(path)


def test_two_dummy_engines_generate_the_same_tokens(config_only: str) -> None:
    prompts = [{"prompt_token_ids": [100 + 7 * i for i in range(n)]} for n in (5, 33)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = []
    for _ in range(2):
        with LLM(config_only, device="cpu", load_format="dummy", max_model_len=256) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append([list(o.outputs[0].token_ids) for o in outs])
    assert runs[0] == runs[1]
    assert all(len(tokens) == 8 for tokens in runs[0])


def test_auto_without_weights_names_dummy(config_only: str) -> None:
    with pytest.raises(ValueError, match=r"no model\.safetensors or model\.safetensors\.index"
                                         r"\.json in .*load_format 'dummy'"):
        LLM(config_only, device="cpu", max_model_len=256)


def test_load_format_is_an_engine_key_with_two_values() -> None:
    assert EngineConfig.from_dict({"load_format": "dummy"}).load_format == "dummy"
    assert EngineConfig().load_format == "auto"
    with pytest.raises(ValueError, match=r"load_format must be one of \['auto', 'dummy'\]; "
                                         r"got 'safetensors'"):
        EngineConfig.from_dict({"load_format": "safetensors"})
