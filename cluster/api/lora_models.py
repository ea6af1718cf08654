"""The models an ingress serves by name: its base model and its LoRA adapters (vLLM's names).

A request's `model` picks what it runs under: the base model's served name (or nothing) is the
base model, an adapter's name that adapter, and any other name is a 404 `model_not_found`.
Adapters come from three places, all checked before a request can use them:

- the manifest's `lora_modules: [{name, path}]`, served from the start (`check_lora_args`
  checks the list before Ray starts; the replicas load and check each adapter at their first
  request under it);
- `POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter` when `allow_runtime_lora_updating`
  is on (cluster/api/lora_routes.py);
- the resolver directory `dynamic_lora_loading_path` (Ray Serve LLM's): a request for model X
  that names no known adapter loads DIR/X, a PEFT directory, on first use.

Invariants: an adapter's `lora_int_id` is a function of its name and path (`lora_int_id`), so
every ingress replica gives the replicas the same `LoRARequest` for it; an adapter is listed
and served only after every running replica loaded and checked it (a bad one is a 400 naming
the field, cluster/engine/lora.py, and is not kept).
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from cluster.api.protocol import RequestError
from cluster.engine.tiny_lora import TINY_LORA_NAME
from scheduler.lora import LoRARequest

LORA_SERVING_DEFAULTS: dict[str, Any] = {
    "lora_modules": None,  # [{name, path}]: adapters served from the start (needs enable_lora)
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING); off: both answer 404 saying how to turn them on
    "allow_runtime_lora_updating": False,
    "dynamic_lora_loading_path": None,  # a directory: a request for model X loads DIR/X
}
# A name the resolver may look up in its directory: one plain path component.
_RESOLVABLE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")


def request_lora(request: Any) -> LoRARequest | None:
    """The adapter an HTTP request's `model` named, as OpenAIServing resolved it when it read
    the body (`request.state.lora_request`); None: the base model."""
    return getattr(request.state, "lora_request", None)


def resolvable(name: str) -> bool:
    """Whether the resolver may look `name` up in its directory (one plain path component)."""
    return _RESOLVABLE.match(name) is not None


def lora_int_id(name: str, path: str) -> int:
    """The adapter's engine id (>= 1): the same on every ingress replica for the same adapter."""
    return zlib.crc32(f"{name}\0{path}".encode()) % 0x7FFFFFFF + 1


def is_adapter_dir(path: Path) -> bool:
    return (path / "adapter_config.json").is_file()


def check_lora_args(serving: dict[str, Any], enable_lora: bool, base_name: str) -> None:
    """The manifest's LoRA serving keys (LORA_SERVING_DEFAULTS); ValueError naming the key."""
    modules = serving["lora_modules"]
    allow = serving["allow_runtime_lora_updating"]
    resolver = serving["dynamic_lora_loading_path"]
    if not isinstance(allow, bool):
        raise ValueError(f"allow_runtime_lora_updating must be true or false; got {allow!r}")
    for key, on in (("lora_modules", modules), ("allow_runtime_lora_updating", allow),
                    ("dynamic_lora_loading_path", resolver)):
        if on and not enable_lora:
            raise ValueError(f"{key} serves LoRA adapters, but enable_lora is false; set "
                             "enable_lora: true (and max_loras, max_lora_rank) in the manifest")
    if allow and serving["ingress_num_replicas"] != 1:
        raise ValueError("allow_runtime_lora_updating needs ingress_num_replicas: 1 (each "
                         "ingress replica keeps the names it was given); with several, serve "
                         "adapters from lora_modules or dynamic_lora_loading_path")
    if resolver is not None and (not isinstance(resolver, str) or not Path(resolver).is_dir()):
        raise ValueError(f"dynamic_lora_loading_path must be a directory of PEFT adapter "
                         f"directories (one per model name); got {resolver!r}")
    lora_modules(modules, base_name)


def lora_modules(modules: Any, base_name: str) -> list[LoRARequest]:
    """The manifest's `lora_modules` as LoRARequests; ValueError naming the entry at fault."""
    if modules is None:
        return []
    if not isinstance(modules, list):
        raise ValueError(f"lora_modules must be a list of {{name, path}}; got {modules!r}")
    out: list[LoRARequest] = []
    for i, entry in enumerate(modules):
        where = f"lora_modules[{i}]"
        if not isinstance(entry, dict) or set(entry) != {"name", "path"}:
            raise ValueError(f"{where} must be {{name: <model name>, path: <PEFT adapter "
                             f"directory>}}; got {entry!r}")
        name, path = entry["name"], entry["path"]
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{where}.name must be a non-empty string; got {name!r}")
        if name == base_name or any(r.lora_name == name for r in out):
            raise ValueError(f"{where}.name {name!r} is already a served model's name; give "
                             "each adapter its own name")
        if not isinstance(path, str) or not (path == TINY_LORA_NAME
                                             or is_adapter_dir(Path(path))):
            raise ValueError(f"{where}.path {path!r} is not a PEFT adapter directory (no "
                             f"adapter_config.json there) nor {TINY_LORA_NAME!r}")
        out.append(LoRARequest(name, lora_int_id(name, path), path))
    return out


class LoRAModels:
    """The adapters one ingress replica serves, by name; `load` asks the replicas to load
    and check one (the EngineClient's `add_lora`)."""

    def __init__(self, modules: list[LoRARequest] | None = None,
                 resolver_dir: str | None = None, allow_runtime_updating: bool = False) -> None:
        self.adapters: dict[str, LoRARequest] = {r.lora_name: r for r in modules or ()}
        self.resolver_dir = resolver_dir
        self.allow_runtime_updating = allow_runtime_updating

    async def resolve(self, model: str | None, base_name: str,
                      load: Callable[[LoRARequest], Awaitable[None]]) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 for no model."""
        if model is None or model == base_name:
            return None
        adapter = self.adapters.get(model)
        if adapter is not None:
            return adapter
        if self.resolver_dir is not None and resolvable(model):
            path = Path(self.resolver_dir) / model
            if is_adapter_dir(path):
                return await self.add(model, str(path), load)
        served = ", ".join(f"`{n}`" for n in [base_name, *self.adapters])
        raise RequestError(f"The model `{model}` does not exist; this server serves {served}",
                           status=404, param="model", code="model_not_found")

    async def add(self, name: str, path: str,
                  load: Callable[[LoRARequest], Awaitable[None]]) -> LoRARequest:
        """Serve adapter `name` from `path` once `load` (every replica) has checked it."""
        adapter = LoRARequest(name, lora_int_id(name, path), path)
        await load(adapter)
        self.adapters[name] = adapter
        return adapter

    def cards(self, base_name: str, max_model_len: int) -> list[dict[str, Any]]:
        """/v1/models' entries of the adapters (vLLM's: `root` the path, `parent` the base)."""
        return [{"id": name, "object": "model", "created": 0, "owned_by": "qwen3-serve",
                 "root": a.lora_path, "parent": base_name, "max_model_len": max_model_len}
                for name, a in self.adapters.items()]
