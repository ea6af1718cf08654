"""A checkpoint's sentence-transformers files: how an embedding model pools, read (and, for the
embedded toy `qwen3-embedding-tiny`, written) as Qwen3-Embedding ships them.

sentence-transformers' layout: `modules.json` lists the modules in order (Transformer, then
`Pooling` at a path such as `1_Pooling`, then optionally `Normalize`); the Pooling module's
`config.json` says the mode (`pooling_mode_lasttoken`, `pooling_mode_mean_tokens`,
`pooling_mode_cls_token`); `config_sentence_transformers.json` holds the named prompts
(Qwen3-Embedding's "query" instruction). `read_pooling_files` returns what vLLM's
`get_pooling_config` takes from them: the pooling type and whether to normalize, or None for a
checkpoint without them.

Invariant: a Pooling module that sets none of the three modes, or another mode (max,
weighted mean), is refused with a ValueError naming it, never served with a guess.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_POOLING_MODULE = "sentence_transformers.models.Pooling"
_NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
# sentence-transformers' flag -> vLLM's pooling type
_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
          "pooling_mode_cls_token": "CLS"}
_UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                      "pooling_mode_weightedmean_tokens")
# Qwen3-Embedding's prompts (config_sentence_transformers.json)
QWEN3_EMBEDDING_PROMPTS = {
    "query": "Instruct: Given a web search query, retrieve relevant passages that answer the "
             "query\nQuery:",
    "document": "",
}


def read_pooling_files(path: str | Path) -> dict[str, Any] | None:
    """{"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": bool} from the checkpoint's
    sentence-transformers files; None when it has no modules.json with a Pooling module."""
    path = Path(path)
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{modules_file} is not valid JSON: {e}") from e
    pooling = next((m for m in modules if m.get("type") == _POOLING_MODULE), None)
    if pooling is None:
        return None
    config_file = path / pooling.get("path", "") / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{modules_file} names a Pooling module at {pooling.get('path')!r}, "
                         f"but {config_file} does not exist")
    config = json.loads(config_file.read_text())
    other = [k for k in _UNSUPPORTED_MODES if config.get(k)]
    if other:
        raise ValueError(f"{config_file} sets {other}; only last-token, mean and CLS pooling "
                         "are implemented")
    modes = [_MODES[k] for k in _MODES if config.get(k)]
    if len(modes) != 1:
        raise ValueError(f"{config_file} must set exactly one of {sorted(_MODES)}; it sets "
                         f"{modes or 'none'}")
    normalize = any(m.get("type") == _NORMALIZE_MODULE for m in modules)
    return {"pooling_type": modes[0], "normalize": normalize}


def write_embedding_layout(directory: Path, config: dict[str, Any]) -> None:
    """Turn a written causal-LM checkpoint into Qwen3-Embedding's layout: the base model's
    tensors without the `model.` prefix (no LM head), and the sentence-transformers files
    (last-token pooling, then Normalize, the query prompt)."""
    from safetensors.torch import load_file, save_file  # (readers of the files need no torch)

    weights = directory / "model.safetensors"
    tensors = load_file(str(weights))
    base = {name.removeprefix("model."): t for name, t in tensors.items()
            if name.startswith("model.")}
    save_file(base, str(weights), metadata={"format": "pt"})
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": _POOLING_MODULE},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": _NORMALIZE_MODULE},
    ]
    _write_json(directory / "modules.json", modules)
    pooling = {"word_embedding_dimension": config["hidden_size"],
               **{flag: False for flag in (*_MODES, *_UNSUPPORTED_MODES)},
               "pooling_mode_lasttoken": True, "include_prompt": True}
    _write_json(directory / "1_Pooling" / "config.json", pooling)
    (directory / "2_Normalize").mkdir(exist_ok=True)
    _write_json(directory / "config_sentence_transformers.json",
                {"prompts": QWEN3_EMBEDDING_PROMPTS, "default_prompt_name": None,
                 "similarity_fn_name": "cosine"})
    _write_json(directory / "sentence_bert_config.json",
                {"max_seq_length": config["max_position_embeddings"], "do_lower_case": False})


def _write_json(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
