"""Several base models in one Serve app (Ray Serve LLM's `build_openai_app` with several
`llm_configs`): the manifest's `models` list, and the front that routes by `model`.

A manifest's `args` are either one model's args (every manifest so far, unchanged) or
`models: [args of one model, ...]` beside the ingress's keys (`INGRESS_KEYS`, one ingress
serves every model). `model_entries` turns either into one (EngineConfig, serving keys) per
model: each becomes its own LLMServer deployment with its own replicas, TP size, autoscaling
and router (serve_app.py), and no engine knows of the others.

`ModelDispatch` is the ingress's ASGI app with several models: one OpenAI app per model
(openai_api.py `create_app`) behind one `FrontDoor` (request ids, the API key). A request
goes to the app that serves its body's `model` (its base name or one of its adapters, or a
name its adapter resolver directory holds; no `model`: the first model); an unknown name is
a 404 listing every served name. `/v1/models`, `/health` and `/metrics` answer for all models
together. Invariant: the served names (base models and their adapters) are distinct across
models, checked before Ray starts.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from cluster.api.front_door import FrontDoor
from cluster.api.lora_models import is_adapter_dir, resolvable
from cluster.api.openai_errors import error_response
from cluster.api.protocol import RequestError

# Args of the one ingress: at the top level of a `models` manifest, never in an entry.
INGRESS_KEYS = ("api_key", "ingress_num_cpus", "ingress_num_replicas",
                "ingress_max_ongoing_requests", "ingress_graceful_shutdown_timeout_s",
                "ingress_on_head_node")
MERGED_ROUTES = ("/v1/models", "/health", "/metrics")  # answered for every model at once


def model_entries(args: dict[str, Any], split: Callable[[dict[str, Any]], tuple[Any, dict]]
                  ) -> list[tuple[Any, dict[str, Any]]]:
    """(EngineConfig, serving keys) per model of a manifest's args (`split`: serve_app's
    `split_args`, the one-model checks); ValueError naming the entry and key at fault."""
    if "models" not in args:
        return [split(args)]
    models, top = args["models"], {k: v for k, v in args.items() if k != "models"}
    if not isinstance(models, list) or not models:
        raise ValueError("models must be a non-empty list, one entry of args per base model "
                         f"(model, tensor_parallel_size, num_replicas, ...); got {models!r}")
    if set(top) - set(INGRESS_KEYS):
        raise ValueError(f"with models, the top-level args are the ingress's only "
                         f"({', '.join(INGRESS_KEYS)}); move {sorted(set(top) - set(INGRESS_KEYS))}"
                         " into the entries of models")
    entries, owner = [], {}
    for i, entry in enumerate(models):
        if not isinstance(entry, dict):
            raise ValueError(f"models[{i}] must be a mapping of one model's args; got {entry!r}")
        if set(entry) & set(INGRESS_KEYS):
            raise ValueError(f"models[{i}] sets {sorted(set(entry) & set(INGRESS_KEYS))}: the "
                             "ingress's keys go at the top level (one ingress serves every model)")
        try:
            config, serving = split({**entry, **top})
        except ValueError as e:
            raise ValueError(f"models[{i}]: {e}") from None
        names = [serving["served_model_name"] or config.model,
                 *(m["name"] for m in serving["lora_modules"] or ())]
        for name in names:
            if name in owner:
                raise ValueError(f"models[{i}] serves {name!r}, which models[{owner[name]}] "
                                 "serves too; give each model (served_model_name) and adapter "
                                 "its own name")
            owner[name] = i
        entries.append((config, serving))
    return entries


def deployment_name(config: Any, serving: dict[str, Any], several: bool) -> str:
    """`LLMServer`, or with several models `LLMServer-<served name>` (Serve's allowed chars)."""
    if not several:
        return "LLMServer"
    return "LLMServer-" + re.sub(r"[^A-Za-z0-9_.-]", "_", serving["served_model_name"]
                                 or config.model)


class ModelDispatch:
    """ASGI: several models' OpenAI apps behind one front door (module docstring)."""

    def __init__(self, apps: list[Any], api_key: str | None) -> None:
        self.apps = apps
        self.front = FrontDoor(self._dispatch, api_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # (lifespan: the apps have no start-up of their own)
            await self.apps[0](scope, receive, send)
            return
        await self.front(scope, receive, send)

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] in MERGED_ROUTES and scope["method"] == "GET":
            await self._merged(scope, send)
            return
        servings = [app.state.serving for app in self.apps]
        limit = max([s.body_limit(await s.info()) for s in servings])
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > limit:
                await error_response(RequestError(
                    f"the request body is at least {len(body)} bytes; this server accepts at "
                    f"most {limit} (max_request_body_bytes)", status=413,
                    code="request_too_large"))(scope, receive, send)
                return
        app = self._app_for(_model_of(body), servings)
        if app is None:
            names = ", ".join(f"`{n}`" for s in servings
                              for n in [s.served_model_name, *s.loras.adapters])
            await error_response(RequestError(
                f"The model `{_model_of(body)}` does not exist; this server serves {names}",
                status=404, param="model", code="model_not_found"))(scope, receive, send)
            return
        await app(scope, _replay(body, receive), send)

    def _app_for(self, model: str | None, servings: list[Any]) -> Any | None:
        if model is None:
            return self.apps[0]
        for app, s in zip(self.apps, servings):
            if model == s.served_model_name or model in s.loras.adapters:
                return app
        for app, s in zip(self.apps, servings):
            if (s.loras.resolver_dir is not None and resolvable(model)
                    and is_adapter_dir(Path(s.loras.resolver_dir) / model)):
                return app
        return None

    async def _merged(self, scope: Scope, send: Send) -> None:
        """GET /v1/models, /health or /metrics of every model, as one answer."""
        answers = [await _call(app, scope) for app in self.apps]
        failed = next((a for a in answers if a[0] != 200), None)
        status, headers, body = failed or answers[0]
        if failed is None and scope["path"] == "/v1/models":
            data = [m for a in answers for m in json.loads(a[2])["data"]]
            body = json.dumps({"object": "list", "data": data}).encode()
        elif failed is None and scope["path"] == "/metrics":
            body = merge_metric_texts([a[2].decode() for a in answers]).encode()
        headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def merge_metric_texts(texts: list[str]) -> str:
    """Several Prometheus texts (one per model, each labelled with its model_name) as one: each
    metric family's HELP and TYPE once, its samples from every text together."""
    families: dict[str, list[str]] = {}
    seen: set[tuple[str, str]] = set()  # (HELP or TYPE, family) already written
    current = ""
    for text in texts:
        for line in text.splitlines():
            if line.startswith("# "):
                _, kind, current = line.split(" ", 3)[:3]
                lines = families.setdefault(current, [])
                if (kind, current) not in seen:
                    seen.add((kind, current))
                    lines.append(line)
            elif line:
                families.setdefault(current, []).append(line)
    return "".join(line + "\n" for lines in families.values() for line in lines)


def _model_of(body: bytes) -> str | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    model = obj.get("model") if isinstance(obj, dict) else None
    return model if isinstance(model, str) else None


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body already read, then whatever else the client sends (its disconnect)."""
    sent = False

    async def again() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return again


async def _call(app: Any, scope: Scope) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """(status, headers, body) of a bodiless request to `app`, in this process."""
    start: dict[str, Any] = {}
    chunks: list[bytes] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            start.update(message)
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
    await app(dict(scope), receive, send)
    return start["status"], list(start.get("headers", [])), b"".join(chunks)
