"""The embedded model and the package layout: what every other test builds on."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import torch

from workers.tiny_model import TINY_CONFIG, TINY_SEED, resolve_model, write_random_qwen3


def _digests(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_tiny_model_is_byte_identical_every_time(tiny_model_path: str, tmp_path: Path) -> None:
    again = write_random_qwen3(tmp_path / "again", TINY_CONFIG, seed=TINY_SEED)
    assert _digests(Path(tiny_model_path)) == _digests(again)
    assert sorted(_digests(again)) == ["config.json", "generation_config.json", "merges.txt",
                                       "model.safetensors", "tokenizer.json",
                                       "tokenizer_config.json", "vocab.json"]


def test_tiny_model_loads_in_transformers(tiny_model_path: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    cfg = model.config
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim) == (4, 128, 4, 2, 32)
    assert cfg.tie_word_embeddings is True
    assert cfg.rope_parameters["rope_theta"] == 1000000.0
    assert model.dtype == torch.float32
    assert tok.eos_token == "<|im_end|>"
    assert tok("Hello world").input_ids == [9707, 1879]
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                  tokenize=False)
    assert ids == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    out = model.generate(torch.tensor([[9707, 1879]]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 6)


def test_unknown_model_name_is_a_clear_error() -> None:
    import pytest

    with pytest.raises(ValueError, match="neither 'qwen3-tiny' nor a checkpoint directory"):
        resolve_model("no-such-model")


def test_our_packages_do_not_shadow_what_transformers_probes() -> None:
    # `kernels` is also the name of Hugging Face's kernel-hub package, which transformers
    # imports when it looks installed; ours must never be mistaken for it.
    code = ("import cluster, workers, kernels, kvcache, scheduler\n"
            "import transformers\n"
            "from transformers.utils import import_utils as iu\n"
            "assert not iu.is_kernels_available()\n"
            "from transformers import AutoModelForCausalLM, Qwen3Config\n"
            "m = AutoModelForCausalLM.from_config(Qwen3Config(hidden_size=32, intermediate_size=64,"
            " num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,"
            " vocab_size=64))\n"
            "print(type(m).__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "Qwen3ForCausalLM"
