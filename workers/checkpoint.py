"""A safetensors checkpoint's files and tensor headers, read with the standard library.

The engine checks a checkpoint (its size, what its tensors are) before it imports torch or
starts a worker, so nothing here reads tensor data: a safetensors file starts with an
8-byte little-endian header length and a JSON header naming each tensor's dtype and shape.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the index's shards, or the single model file."""
    path = Path(model_dir)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not weight_map:
            raise ValueError(f"{index} has no weight_map")
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} names shard files that do not exist: {missing}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise ValueError(f"no model.safetensors or model.safetensors.index.json in {str(path)!r}; "
                     "the worker loads safetensors checkpoints only (load_format 'dummy' runs "
                     "config.json's shapes with random weights instead)")


def tensor_dtypes(model_dir: str | Path) -> dict[str, str]:
    """Every tensor of the checkpoint -> its safetensors dtype ("BF16", "F8_E4M3", "I32", ...)."""
    out: dict[str, str] = {}
    for file in checkpoint_files(model_dir):
        with file.open("rb") as f:
            try:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
            except (struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{file} is not a safetensors file: {e}") from e
        out.update({name: meta["dtype"] for name, meta in header.items()
                    if name != "__metadata__"})
    return out
