"""A `pd` manifest's checks (cluster/api/pd_app.py `pd_entries`), as `./dev serve` runs them
before Ray starts: manifests/qwen3-pd.yaml passes; roles whose KV cannot move block by block
and rank by rank, and a malformed `pd`, are refused naming the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.api.pd_app import pd_entries
from cluster.api.serve_app import check_args, split_args

MANIFEST = Path(__file__).resolve().parents[3] / "manifests" / "qwen3-pd.yaml"


def _args() -> dict[str, Any]:
    return dict(yaml.safe_load(MANIFEST.read_text())["applications"][0]["args"])


def test_the_manifest_makes_a_prefill_and_a_decode_role() -> None:
    check_args(_args())
    (p, ps), (d, ds) = pd_entries(_args(), split_args)
    assert (p.kv_role, d.kv_role) == ("prefill", "decode")
    assert (p.max_num_seqs, d.max_num_seqs) == (16, 64)
    assert d.kv_transfer_timeout_s == 10 and ps["num_replicas"] == ds["num_replicas"] == 1
    assert p.model == d.model == "qwen3-tiny"


@pytest.mark.parametrize("change,message", [
    ({"decode": {"tensor_parallel_size": 2, "executor": "ray"}},
     "prefill's tensor_parallel_size is 1, decode's 2; .* same tensor_parallel_size"),
    ({"prefill": {"block_size": 32}}, "same block_size"),
    ({"decode": {"kv_transport": "rdt", "executor": "ray"}},
     "prefill's kv_transport is None, decode's 'rdt'; .* same kv_transport"),
    ({"prefill": {"kv_role": "decode"}}, "pd.prefill sets kv_role"),
    ({"decode": {"max_num_seqz": 3}}, r"pd.decode: unknown engine argument"),
    ({"prefill": {"served_model_name": "a"}}, "set served_model_name at the top level"),
])
def test_roles_that_cannot_share_kv_are_refused(change: dict, message: str) -> None:
    args = _args()
    for role, over in change.items():
        args["pd"][role] = {**args["pd"][role], **over}
    with pytest.raises(ValueError, match=message):
        check_args(args)


@pytest.mark.parametrize("pd", [{"prefill": {}}, {"prefill": {}, "decode": 3}, []])
def test_a_malformed_pd_is_refused(pd: Any) -> None:
    with pytest.raises(ValueError, match="exactly the keys prefill and decode"):
        check_args({**_args(), "pd": pd})


def test_pd_with_models_is_refused() -> None:
    with pytest.raises(ValueError, match="pd and models cannot be combined"):
        check_args({"pd": _args()["pd"], "models": [{"model": "qwen3-tiny"}]})
