"""Two tp-1 qwen3-tiny replicas behind the prefix-aware router, over real HTTP
(manifests/qwen3-tiny-2x.yaml's args): where requests go, read from X-Replica-Id."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml
from session_ports import free_port

pytestmark = pytest.mark.slow

MANIFEST = Path(__file__).resolve().parents[3] / "manifests" / "qwen3-tiny-2x.yaml"
WORDS = ("river stone maple copper lantern violet harbor meadow falcon ember quartz willow "
         "canyon thistle orbit saffron glacier pepper tundra cobalt").split()


def system_prompt(seed: int, words: int = 160) -> str:
    """A long system prompt (~10 blocks of 16 tokens), different for each seed."""
    return " ".join(WORDS[(seed * 7 + i * (seed + 3)) % len(WORDS)] for i in range(words))


@pytest.fixture(scope="module")
def base_url(ray_cluster: None) -> Iterator[str]:
    from ray import serve
    from ray.serve.context import _get_global_client

    from cluster.api.serve_app import build_app

    args = dict(yaml.safe_load(MANIFEST.read_text())["applications"][0]["args"])
    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    port = _get_global_client().http_config.port  # (Serve may already run with its own)
    serve.run(build_app(args), name="qwen3-2x", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    wait_until_the_ingress_routes_to(url, args["num_replicas"])
    yield url
    serve.delete("qwen3-2x")
    serve.shutdown()  # the next module starts Serve with its own HTTP port


def wait_until_the_ingress_routes_to(base_url: str, replicas: int, timeout_s: float = 60) -> None:
    """Send short prompts of their own until `replicas` replicas have answered one.

    serve.run returns once the controller has every replica running, but the ingress's router
    learns of them later (Serve's long poll), and Serve asks a replica it has not routed to in
    10 s for its queue length with a 0.1 s deadline, falling through to the router's next
    choice when it misses it (a replica still cold on a busy host): either way a new prefix
    lands beside another (CI, stop 57: both conversations on one replica). The tests below
    are about the policy once every replica is routable, so they start from there.
    """
    deadline, seen, sent = time.monotonic() + timeout_s, set(), 0
    while len(seen) < replicas:
        assert time.monotonic() < deadline, f"only {sorted(seen)} answered in {timeout_s} s"
        sent += 1  # (a new prefix each time: a repeated one would go back where it went)
        seen.add(replica_of(chat(base_url, system_prompt(100 + sent, words=24), "hi",
                                 max_tokens=1)))


def chat(base_url: str, system: str, user: str, *, key: str | None = None,
         headers: dict[str, str] | None = None, max_tokens: int = 2) -> httpx.Response:
    body = {"messages": [{"role": "system", "content": system},
                         {"role": "user", "content": user}],
            "max_tokens": max_tokens, "temperature": 0}
    if key is not None:
        body["prompt_cache_key"] = key
    return httpx.post(f"{base_url}/v1/chat/completions", json=body, headers=headers or {},
                      timeout=60)


def replica_of(resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    return resp.headers["x-replica-id"]


def test_two_conversations_each_stay_on_their_own_replica(base_url: str) -> None:
    a, b = system_prompt(1), system_prompt(2)
    seen_a, seen_b = [], []
    for turn in range(4):
        seen_a.append(replica_of(chat(base_url, a, f"question {turn} about rivers")))
        seen_b.append(replica_of(chat(base_url, b, f"question {turn} about stones")))
        time.sleep(0.3)  # a poll period: the replicas' own events confirm what they hold
    assert len(set(seen_a)) == 1 and len(set(seen_b)) == 1, (seen_a, seen_b)
    assert seen_a[0] != seen_b[0]  # a new prefix goes to the replica holding less


def test_a_flood_of_one_prefix_still_uses_both_replicas(base_url: str) -> None:
    system = system_prompt(3)
    replica_of(chat(base_url, system, "warm up"))
    with ThreadPoolExecutor(16) as pool:
        replicas = list(pool.map(
            lambda i: replica_of(chat(base_url, system, f"flood {i}", max_tokens=16)),
            range(24)))
    assert len(set(replicas)) == 2, replicas


def test_prompt_cache_key_and_session_header_keep_a_session_on_one_replica(
        base_url: str) -> None:
    # The first test left system prompt 1 on one replica and 2 on the other: a session that
    # starts on 2's stays there even when it turns to 1's prefix (the key beats the match).
    home_1 = replica_of(chat(base_url, system_prompt(1), "where?"))
    home_2 = replica_of(chat(base_url, system_prompt(2), "where?"))
    assert home_1 != home_2
    for session in ({"key": "session-k"}, {"headers": {"X-Session-Id": "session-h"}}):
        first = replica_of(chat(base_url, system_prompt(2), "start", **session))
        rest = {replica_of(chat(base_url, system_prompt(seed), f"turn {seed}", **session))
                for seed in (1, 1, 10, 11)}
        assert first == home_2 and rest == {home_2}, (session, rest)
    assert replica_of(chat(base_url, system_prompt(1), "no key")) == home_1


def test_prompt_cache_key_of_the_wrong_type_is_a_400_naming_it(base_url: str) -> None:
    resp = httpx.post(f"{base_url}/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], "prompt_cache_key": 42})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "prompt_cache_key"


def test_killing_a_replica_mid_run_loses_no_request(base_url: str) -> None:
    # Last in the module: it kills one LLMServer replica's actor.
    from ray._private.state import actors  # the GCS's table; the state API needs a dashboard

    system = system_prompt(40)
    victim = replica_of(chat(base_url, system, "before"))
    servers = [a for a in actors(actor_state_name="ALIVE").values()
               if a["ActorClassName"].endswith(":LLMServer")]
    assert len(servers) == 2
    pid = next(a["Pid"] for a in servers if victim in a.get("Name", ""))

    def one(i: int) -> str:
        if i == 6:
            os.kill(pid, signal.SIGKILL)
        return replica_of(chat(base_url, system, f"during {i}", max_tokens=1))

    with ThreadPoolExecutor(4) as pool:
        replicas = list(pool.map(one, range(24)))
    assert len(replicas) == 24  # every request answered 200 (replica_of asserts it)
    after = [replica_of(chat(base_url, system, f"after {i}", max_tokens=1)) for i in range(3)]
    assert victim not in after  # the conversation moved on; the dead replica's holdings with it
