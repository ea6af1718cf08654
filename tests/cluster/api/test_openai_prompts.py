"""cluster/api/openai_prompts.py's text encoder: the tokenizer's Rust backend called directly
gives exactly transformers' ids, and a backend that would not is never used."""

from __future__ import annotations

import random
from typing import Any

from transformers import AutoTokenizer

from cluster.api.openai_prompts import PromptProcessor, text_encoder


def test_the_backend_encoder_gives_transformers_ids(tiny_model_path: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    encode = text_encoder(tok)
    assert encode.__name__ == "fast"  # the Rust backend, not transformers' layers
    rng = random.Random(0)
    texts = [tok.decode([rng.randrange(100, 151000) for _ in range(n)]) for n in (1, 7, 256)]
    texts += ["<|im_start|>user\nhi <|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>",
              "<tool_call>{\"a\": 1}</tool_call><|endoftext|>", "   \n\n\t  x  ", "é你🙂",
              tok.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False,
                                      add_generation_prompt=True)]
    for text in texts:
        assert encode(text) == tok.encode(text, add_special_tokens=False), text
    prompts = PromptProcessor(tok)
    assert prompts.completion_prompts(texts[2], 4096) == [tok.encode(texts[2],
                                                                     add_special_tokens=False)]


class _Backend:
    def __init__(self, shift: int) -> None:
        self.shift = shift

    def encode_batch_fast(self, texts: list[str], add_special_tokens: bool) -> list[Any]:
        class _Enc:
            ids = [ord(c) + self.shift for c in texts[0]]
        return [_Enc()]


class _Tokenizer:
    """A character-level tokenizer whose backend agrees with it (shift 0) or not."""

    def __init__(self, shift: int | None) -> None:
        if shift is not None:
            self.backend_tokenizer = _Backend(shift)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def get_added_vocab(self) -> dict[str, int]:
        return {"<s>": 1}


def test_a_backend_that_disagrees_or_is_missing_is_not_used() -> None:
    assert text_encoder(_Tokenizer(0)).__name__ == "fast"
    for tok in (_Tokenizer(1), _Tokenizer(None)):
        encode = text_encoder(tok)
        assert encode.__name__ == "slow" and encode("ab") == [97, 98]
