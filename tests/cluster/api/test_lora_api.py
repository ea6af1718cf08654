"""LoRA in the HTTP front without Ray: the manifest's LoRA keys and their refusals, the names a
request's `model` resolves to, the runtime routes when off, the router's preference for a
replica holding the adapter, and the metrics vLLM names (the real stack: test_lora_serve.py)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

import pytest
from fake_engine import FakeEngine, fetch

from cluster.api.kv_holdings import HoldingsView
from cluster.api.lora_models import LoRAModels, lora_int_id, lora_modules
from cluster.api.prefix_router import ADAPTER_TOKENS, RoutingThresholds, rank_replicas
from cluster.api.prometheus import parse_prometheus, render_prometheus
from cluster.api.protocol import RequestError
from cluster.api.serve_app import check_args
from kvcache.events import KVEventBatch
from scheduler import QueueLoad
from scheduler.lora import LoRARequest


def _adapter_dir(root: Path, name: str) -> str:
    path = root / name
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    return str(path)


@pytest.fixture
def lora_dir(tmp_path: Path) -> Path:
    _adapter_dir(tmp_path, "sql")
    _adapter_dir(tmp_path, "chat")
    return tmp_path


def _args(**kw: Any) -> dict[str, Any]:
    return {"model": "qwen3-tiny", "device": "cpu", "enable_lora": True, **kw}


def test_lora_keys_pass_the_manifest_checks(lora_dir: Path) -> None:
    check_args(_args(lora_modules=[{"name": "sql", "path": str(lora_dir / "sql")}],
                     allow_runtime_lora_updating=True,
                     dynamic_lora_loading_path=str(lora_dir), max_loras=2, max_cpu_loras=4))
    check_args({"model": "qwen3-tiny"})  # a manifest without LoRA is unchanged


@pytest.mark.parametrize("kw, message", [
    ({"enable_lora": False, "lora_modules": [{"name": "a", "path": "{sql}"}]},
     "lora_modules serves LoRA adapters, but enable_lora is false"),
    ({"enable_lora": False, "allow_runtime_lora_updating": True},
     "allow_runtime_lora_updating serves LoRA adapters, but enable_lora is false"),
    ({"enable_lora": False, "dynamic_lora_loading_path": "{dir}"},
     "dynamic_lora_loading_path serves LoRA adapters, but enable_lora is false"),
    ({"lora_modules": {"name": "a", "path": "{sql}"}}, "lora_modules must be a list"),
    ({"lora_modules": [{"name": "a"}]}, r"lora_modules\[0\] must be \{name"),
    ({"lora_modules": [{"name": "a", "path": "{sql}", "base_model_name": "x"}]},
     r"lora_modules\[0\] must be \{name"),
    ({"lora_modules": [{"name": "", "path": "{sql}"}]},
     r"lora_modules\[0\].name must be a non-empty string"),
    ({"lora_modules": [{"name": "a", "path": "{sql}"}, {"name": "a", "path": "{chat}"}]},
     r"lora_modules\[1\].name 'a' is already a served model's name"),
    ({"lora_modules": [{"name": "qwen3-tiny", "path": "{sql}"}]},
     r"lora_modules\[0\].name 'qwen3-tiny' is already"),
    ({"lora_modules": [{"name": "a", "path": "{dir}/nowhere"}]},
     r"lora_modules\[0\].path .* is not a PEFT adapter directory"),
    ({"allow_runtime_lora_updating": "yes"}, "allow_runtime_lora_updating must be true or false"),
    ({"allow_runtime_lora_updating": True, "ingress_num_replicas": 2},
     "allow_runtime_lora_updating needs ingress_num_replicas: 1"),
    ({"dynamic_lora_loading_path": "{dir}/nowhere"},
     "dynamic_lora_loading_path must be a directory"),
    ({"max_loras": 0}, "max_loras"),
    ({"max_lora_rank": "16"}, "max_lora_rank"),
    ({"max_loras": 4, "max_cpu_loras": 2}, r"max_cpu_loras \(2\) must be >= max_loras \(4\)"),
])
def test_bad_lora_keys_are_refused_naming_the_key(lora_dir: Path, kw: dict, message: str) -> None:
    subst = {"sql": str(lora_dir / "sql"), "chat": str(lora_dir / "chat"), "dir": str(lora_dir)}
    kw = json.loads(json.dumps(kw).replace("{sql}", subst["sql"]).replace(
        "{chat}", subst["chat"]).replace("{dir}", subst["dir"]))
    with pytest.raises(ValueError, match=message):
        check_args(_args(**kw))


def test_an_adapter_id_is_a_function_of_its_name_and_path(lora_dir: Path) -> None:
    [a] = lora_modules([{"name": "sql", "path": str(lora_dir / "sql")}], "base")
    assert a == LoRARequest("sql", lora_int_id("sql", str(lora_dir / "sql")),
                            str(lora_dir / "sql"))
    assert lora_int_id("sql", "/a") == lora_int_id("sql", "/a") != lora_int_id("sql", "/b")
    assert 1 <= lora_int_id("x", "/y") < 2**31


def test_model_names_resolve_to_the_base_an_adapter_or_a_404(lora_dir: Path) -> None:
    loaded: list[LoRARequest] = []

    async def load(adapter: LoRARequest) -> None:
        loaded.append(adapter)

    static = lora_modules([{"name": "sql", "path": str(lora_dir / "sql")}], "base")
    models = LoRAModels(static, resolver_dir=str(lora_dir))

    async def go() -> None:
        assert await models.resolve(None, "base", load) is None
        assert await models.resolve("base", "base", load) is None
        assert await models.resolve("sql", "base", load) == static[0]
        chat = await models.resolve("chat", "base", load)  # the resolver's, on first use
        assert chat == LoRARequest("chat", lora_int_id("chat", str(lora_dir / "chat")),
                                   str(lora_dir / "chat"))
        assert await models.resolve("chat", "base", load) == chat  # loaded once
        for name in ("nope", "../sql", "/etc", ".hidden"):
            with pytest.raises(RequestError) as e:
                await models.resolve(name, "base", load)
            assert (e.value.status, e.value.code, e.value.param) == (404, "model_not_found",
                                                                     "model")
            assert "`base`, `sql`, `chat`" in str(e.value)

    asyncio.run(go())
    assert [a.lora_name for a in loaded] == ["chat"]
    cards = models.cards("base", 128)
    assert [(c["id"], c["parent"], c["root"]) for c in cards] == [
        ("sql", "base", str(lora_dir / "sql")), ("chat", "base", str(lora_dir / "chat"))]


def test_an_adapter_the_replicas_refuse_is_not_served(lora_dir: Path) -> None:
    async def refuse(adapter: LoRARequest) -> None:
        raise ValueError(f"LoRA adapter {adapter.lora_path!r}: r=64 exceeds max_lora_rank=16")

    models = LoRAModels(resolver_dir=str(lora_dir))
    with pytest.raises(ValueError, match="max_lora_rank=16"):
        asyncio.run(models.resolve("sql", "base", refuse))
    assert models.adapters == {}


@pytest.mark.parametrize("path", ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"])
def test_runtime_routes_are_404_saying_how_to_turn_them_on(engine: FakeEngine, tokenizer: Any,
                                                           path: str) -> None:
    resp = fetch(engine, tokenizer, "POST", path, {"lora_name": "a", "lora_path": "/x"})
    assert resp.status_code == 404
    assert "allow_runtime_lora_updating: true" in resp.json()["error"]["message"]


def test_an_unknown_model_is_a_404_naming_the_served_one(engine: FakeEngine,
                                                         tokenizer: Any) -> None:
    resp = fetch(engine, tokenizer, "POST", "/v1/completions",
                 {"model": "other", "prompt": "hi", "max_tokens": 2})
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == "model_not_found"
    assert "`fake-qwen3`" in resp.json()["error"]["message"]
    ok = fetch(engine, tokenizer, "POST", "/v1/completions",
               {"model": "fake-qwen3", "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["model"] == "fake-qwen3"


def _rank(loads: dict[str, int], holders: set[str], matches: dict[str, float] | None = None,
          ) -> tuple[list[str], str]:
    return rank_replicas(list(loads), loads, matches or {}, None, RoutingThresholds(8, 1.5),
                         random.Random(0), None, None, 16, holders)


def test_a_replica_holding_the_adapter_is_preferred_within_the_guard() -> None:
    assert _rank({"a": 0, "b": 0}, {"b"}) == (["b", "a"], "adapter")
    assert _rank({"a": 0, "b": 3}, {"b"}) == (["b", "a"], "adapter")
    # a longer prefix elsewhere outweighs the adapter (ADAPTER_TOKENS / 16 / 2 blocks)
    blocks = ADAPTER_TOKENS / 16 / 2 + 1
    assert _rank({"a": 0, "b": 0}, {"b"}, {"a": blocks})[0][0] == "a"
    # the holder is overloaded: another replica gets the request (and loads the adapter)
    assert _rank({"a": 0, "b": 12}, {"b"}) == (["a", "b"], "balance")


def test_the_view_knows_which_replicas_hold_an_adapter() -> None:
    clock = [100.0]
    view = HoldingsView(recent_ttl_s=5.0, clock=lambda: clock[0])
    view.retain(["r1", "r2"])
    view.apply("r1", KVEventBatch("e", 0, [], False), QueueLoad(0, 0, 0), ["sql"])
    view.note_adapter("r2", "chat")
    assert view.holding_adapter("sql", ["r1", "r2"]) == {"r1"}
    assert view.holding_adapter("chat", ["r1", "r2"]) == {"r2"}
    clock[0] += 6.0  # r2 never reported it: the note expires
    view.apply("r2", KVEventBatch("e", 0, [], False), QueueLoad(0, 0, 0), [])
    assert view.holding_adapter("chat", ["r1", "r2"]) == set()
    view.apply("r1", KVEventBatch("e", 0, [], False), QueueLoad(0, 0, 0), [])  # unloaded
    assert view.holding_adapter("sql", ["r1", "r2"]) == set()


def test_metrics_have_vllms_lora_info_and_requests_per_adapter(engine: FakeEngine) -> None:
    def snap(rid: str, running: list[str], waiting: list[str], counts: dict[str, int]) -> dict:
        return {**engine.metrics(), "replica_id": rid, "max_lora": 2, "lora_loaded": running,
                "lora_running": running, "lora_waiting": waiting, "lora_requests_total": counts}

    before = time.time()
    samples = parse_prometheus(render_prometheus(
        [snap("r1", ["sql"], ["chat"], {"sql": 3, "chat": 1}),
         snap("r2", ["chat"], [], {"chat": 2})], "qwen3-tiny"))
    info = {k: v for k, v in samples.items() if k.startswith("vllm:lora_requests_info")}
    assert list(info) == ['vllm:lora_requests_info{model_name="qwen3-tiny",max_lora="2",'
                          'running_lora_adapters="chat,sql",waiting_lora_adapters="chat"}']
    assert before <= next(iter(info.values())) <= time.time() + 1
    assert samples['qwen3_serve:lora_requests_total{model_name="qwen3-tiny",'
                   'lora_name="chat"}'] == 3
    assert samples['qwen3_serve:lora_requests_total{model_name="qwen3-tiny",'
                   'lora_name="sql"}'] == 3
    # LoRA off: no LoRA series at all
    plain = render_prometheus([engine.metrics()], "qwen3-tiny")
    assert "lora" not in plain


class _FakeStreams:
    """A DeploymentHandle stand-in: its first stream hands over after one token (a draining
    replica), the next one finishes; records what each `generate.remote` was given."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple, dict]] = []
        self.generate = self

    def options(self, **_: Any) -> _FakeStreams:
        return self

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        from cluster.api.drain import HANDOFF
        from cluster.api.handle_client import pack_output
        from scheduler import CompletionOutput, RequestOutput

        self.calls.append((args, kwargs))
        first = len(self.calls) == 1
        out = RequestOutput(args[2], args[0], [CompletionOutput(
            0, [7 if first else 8], "x", None if first else "length", None, None)],
            not first, 0)

        async def items() -> Any:
            yield pack_output(out)
            if first:
                yield HANDOFF

        class Stream:  # (Serve's DeploymentResponseGenerator: iterable and cancellable)
            def __aiter__(self) -> Any:
                return items()

            def cancel(self) -> None:
                pass
        return Stream()


def test_a_resumed_request_keeps_its_adapter() -> None:
    from cluster.api.handle_client import HandleEngineClient
    from scheduler import SamplingParams

    handle = _FakeStreams()
    lora = LoRARequest("sql", 5, "/adapters/sql")
    client = HandleEngineClient(handle)  # type: ignore[arg-type]

    async def go() -> list[list[int]]:
        return [out.outputs[0].token_ids async for out in client.generate(
            [1, 2, 3], SamplingParams(max_tokens=2), "r1", lora_request=lora)]

    assert asyncio.run(go()) == [[7], [8]]
    assert [kw["lora_request"] for _, kw in handle.calls] == [lora, lora]
    assert [kw["resume_token_ids"] for _, kw in handle.calls] == [None, [7]]
