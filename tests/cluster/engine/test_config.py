"""EngineConfig.resolve_device: the one answer to "cpu or cuda?" for the engine and the Serve app."""

from __future__ import annotations

import pytest
import ray
import torch

from cluster.engine.config import EngineConfig


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("from_ray", [False, True])
def test_explicit_device_is_kept_without_probing(device: str, from_ray: bool,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    def no_probe() -> None:
        raise AssertionError("an explicit device must not probe Ray or CUDA")

    monkeypatch.setattr(ray, "cluster_resources", no_probe)
    monkeypatch.setattr(torch.cuda, "is_available", no_probe)
    assert EngineConfig(device=device).resolve_device(from_ray=from_ray) == device


@pytest.mark.parametrize(("resources", "expected"), [
    ({"CPU": 4.0, "GPU": 1.0}, "cuda"), ({"CPU": 4.0, "GPU": 0.5}, "cpu"), ({"CPU": 4.0}, "cpu")])
def test_auto_from_ray_asks_the_cluster_not_this_process(
        resources: dict[str, float], expected: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray, "cluster_resources", lambda: resources)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: expected == "cpu")
    assert EngineConfig().resolve_device(from_ray=True) == expected


@pytest.mark.parametrize(("has_cuda", "expected"), [(True, "cuda"), (False, "cpu")])
def test_auto_in_process_asks_torch_not_the_cluster(
        has_cuda: bool, expected: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"GPU": 0.0 if has_cuda else 8.0})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: has_cuda)
    assert EngineConfig().resolve_device(from_ray=False) == expected


@pytest.mark.parametrize(("field", "value"), [("reasoning_parser", "deepseek_r1"),
                                              ("tool_call_parser", "mistral")])
def test_unknown_parser_names_the_valid_ones(field: str, value: str) -> None:
    with pytest.raises(ValueError, match=rf"{field} must be one of \[None, '"):
        EngineConfig(**{field: value})
    assert getattr(EngineConfig(reasoning_parser="qwen3", tool_call_parser="hermes"),
                   field) in ("qwen3", "hermes")
