"""The row stages around the engine: chat template and tokenization, and the batch <-> rows
conversion every stage shares.

Invariants: a stage never drops a row, and a row whose `error` is set passes every later stage
unchanged (the engine skips it too), so one bad row costs only itself. Every row leaving a
stage has an `error` column (None for good rows). Prompts are tokenized without special
tokens, as `LLM.generate` and the HTTP API do (the chat template writes its own). The
tokenizer is loaded once per Ray worker process and kept (tasks of a stage reuse it).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import pyarrow as pa

if TYPE_CHECKING:
    from cluster.engine.config import EngineConfig
    from cluster.engine.pooling import PoolingInfo


@functools.lru_cache(maxsize=4)
def tokenizer_for(model: str) -> Any:
    """The model's tokenizer (an embedded model's name or a checkpoint path), once per process."""
    from transformers import AutoTokenizer

    from workers.tiny_model import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(model))


def engine_pooling(config: EngineConfig) -> PoolingInfo | None:
    """The PoolingInfo of the engine an EngineConfig builds (None: a generation model), found
    without starting it."""
    from cluster.engine.pooling import resolve_pooling
    from workers.tiny_model import resolve_model

    return resolve_pooling(resolve_model(config.model), config, tokenizer_for(config.model))


def rows_of(batch: pa.Table) -> list[dict[str, Any]]:
    return batch.to_pylist()


def columns_of(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Rows back into one list per column; a key some rows lack is None in those rows."""
    names: dict[str, None] = {}
    for row in rows:
        names.update(dict.fromkeys(row))
    names.setdefault("error", None)
    return {name: [row.get(name) for row in rows] for name in names}


def _plain(value: Any) -> Any:
    """A chat message as the template takes it: Arrow fills keys other rows had with None."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def apply_chat_template(batch: pa.Table, model: str,
                        chat_template_kwargs: dict[str, Any]) -> dict[str, list[Any]]:
    """`messages` rows get `prompt`: the conversation through the model's chat template with
    the generation prompt (LLM.chat's rendering). A template that refuses the messages is
    that row's error."""
    tok = tokenizer_for(model)
    rows = rows_of(batch)
    for row in rows:
        if row.get("error") or row.get("messages") is None:
            continue
        try:
            row["prompt"] = tok.apply_chat_template(_plain(row["messages"]), tokenize=False,
                                                    add_generation_prompt=True,
                                                    **chat_template_kwargs)
        except Exception as e:  # noqa: BLE001 - the template's complaint is this row's error
            row["error"] = f"the chat template rejected the messages: {e}"
    return columns_of(rows)


def tokenize(batch: pa.Table, model: str, add_special_tokens: bool = False
             ) -> dict[str, list[Any]]:
    """`prompt` rows get `prompt_token_ids`; a row with neither is that row's error."""
    tok = tokenizer_for(model)
    rows = rows_of(batch)
    for row in rows:
        if row.get("error") or row.get("prompt_token_ids") is not None:
            continue
        prompt = row.get("prompt")
        if not isinstance(prompt, str):
            row["error"] = ("a row needs `messages` (a chat), `prompt` (a string) or "
                            f"`prompt_token_ids`; got prompt={prompt!r}")
            continue
        row["prompt_token_ids"] = tok.encode(prompt, add_special_tokens=add_special_tokens)
    return columns_of(rows)
