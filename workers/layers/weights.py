"""A checkpoint tensor that a `weight_loader` reads only its own shard of.

`weight_loader(param, loaded, shard_id=None)` receives a `WeightSource`: over safetensors it
reads just the requested rows/columns from the memory-mapped file (`get_slice`), so a rank
never materialises another rank's part of a large matrix.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor


class WeightSource:
    """A full checkpoint tensor, read lazily: `shape`, `narrow(dim, start, length)`, `full()`."""

    def __init__(self, name: str, tensor: Tensor | None = None, safe_slice: Any = None) -> None:
        if (tensor is None) == (safe_slice is None):
            raise ValueError("WeightSource needs exactly one of tensor or safe_slice")
        self.name = name
        self._tensor = tensor
        self._slice = safe_slice
        self.shape: tuple[int, ...] = (tuple(tensor.shape) if tensor is not None
                                       else tuple(safe_slice.get_shape()))

    def narrow(self, dim: int, start: int, length: int) -> Tensor:
        if start < 0 or start + length > self.shape[dim]:
            raise ValueError(f"checkpoint tensor {self.name} has shape {self.shape}; cannot read "
                             f"[{start}, {start + length}) of dim {dim}")
        if self._tensor is not None:
            return self._tensor.narrow(dim, start, length)
        index = tuple(slice(None) for _ in range(dim)) + (slice(start, start + length),)
        return self._slice[index]

    def full(self) -> Tensor:
        return self._tensor if self._tensor is not None else self._slice[:]


def copy_checked(param: Tensor, loaded: Tensor, name: str) -> None:
    """`param.copy_(loaded)` (dtype-converting) after a shape check a user can read."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"checkpoint tensor {name} gives a shard of shape {tuple(loaded.shape)}, "
                         f"the model expects {tuple(param.shape)}: does config.json match the "
                         "weights?")
    param.data.copy_(loaded)


def default_weight_loader(param: Tensor, loaded: WeightSource) -> None:
    """Replicated parameters (norms): every rank loads the whole tensor."""
    copy_checked(param, loaded.full(), loaded.name)
