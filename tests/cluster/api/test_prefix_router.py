"""The prefix-aware router's pieces without Serve: the policy, the holdings view fed by a real
KVCacheManager's event log, affinity spill, replicas leaving, and the hash across processes."""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import subprocess
import sys
import time

import pytest

from cluster.api.kv_holdings import SHARED, HoldingsView
from cluster.api.prefix_router import RoutingThresholds, rank_replicas
from kvcache import KVCacheManager, prompt_block_hashes
from kvcache.events import CPU, DEVICE, STORED, KVEventBatch
from scheduler import QueueLoad

TH = RoutingThresholds(imbalance_abs=4, imbalance_rel=1.5)
IDLE = QueueLoad(0, 0, 0)
SYSTEM_A = list(range(1000, 1064))  # four blocks of 16
SYSTEM_B = list(range(2000, 2064))


def rank(loads, matches=None, affinity=None, sizes=None, th=TH, work=None):
    return rank_replicas(list(loads), loads, matches or {}, affinity, th, random.Random(0),
                         sizes, work)


def test_best_match_wins_while_loads_are_within_the_thresholds():
    assert rank({"a": 3, "b": 0}, {"a": 4.0, "b": 1.0}) == (["a", "b"], "prefix")
    assert rank({"a": 0, "b": 0}, {"a": 1.0, "b": 3.0}) == (["b", "a"], "prefix")
    # equal matches: the less loaded one
    assert rank({"a": 2, "b": 1}, {"a": 2.0, "b": 2.0}) == (["b", "a"], "prefix")


def test_imbalance_guard_ranks_by_load_past_both_thresholds():
    # 5 more than the least loaded and more than 1.5x: the prefix match does not matter
    assert rank({"a": 5, "b": 0}, {"a": 4.0}) == (["b", "a"], "balance")
    assert rank({"a": 16, "b": 11}, {"a": 4.0}) == (["a", "b"], "prefix")  # 16 < 1.5 x 11
    assert rank({"a": 4, "b": 0}, {"a": 4.0}) == (["a", "b"], "prefix")  # only 4 more


def test_no_match_goes_to_the_least_loaded_then_the_emptier_cache():
    assert rank({"a": 1, "b": 0}) == (["b", "a"], "load")
    assert rank({"a": 0, "b": 0}, sizes={"a": 10, "b": 2}) == (["b", "a"], "load")


def test_a_prefix_goes_home_unless_its_home_owes_twice_the_work_of_recomputing_it():
    # four blocks (64 tokens) held on a: a wins while it owes fewer than 2 x 64 more tokens
    assert rank({"a": 1, "b": 1}, {"a": 4.0}, work={"a": 120, "b": 0}) == (["a", "b"], "prefix")
    assert rank({"a": 1, "b": 1}, {"a": 4.0}, work={"a": 130, "b": 0}) == (["b", "a"], "load")
    # no match anywhere: the replica owing least, not the one with fewer requests
    assert rank({"a": 3, "b": 1}, work={"a": 0, "b": 2000}) == (["a", "b"], "load")


def test_an_overloaded_replica_goes_last_and_the_best_of_the_rest_wins():
    loads = {"a": 10, "b": 2, "c": 3}
    assert rank(loads, {"a": 4.0, "c": 2.0}) == (["c", "b", "a"], "balance")
    assert rank(loads, {"c": 2.0}) == (["c", "b", "a"], "prefix")
    assert rank(loads, {"a": 4.0}, affinity="a")[0][0] == "b"  # the session spills


def test_affinity_keeps_a_session_until_its_replica_is_overloaded_then_spills():
    assert rank({"a": 0, "b": 3}, {"a": 4.0}, affinity="b") == (["b", "a"], "affinity")
    assert rank({"a": 0, "b": 5}, {"a": 4.0, "b": 4.0}, affinity="b")[0][0] == "a"
    assert rank({"a": 0, "b": 0}, affinity="gone")[1] == "load"  # a replica no longer there


def batch_of(m: KVCacheManager, cursor):
    return m.events.since(*cursor)


def test_view_follows_stored_and_evicted_blocks_and_scores_leading_blocks():
    m = KVCacheManager(num_gpu_blocks=8, num_cpu_blocks=0, block_size=16)
    view = HoldingsView()
    view.retain(["r1", "r2"])
    m.allocate_slots(1, SYSTEM_A + [7] * 10, 74)
    view.apply("r1", batch_of(m, (None, 0)), load=QueueLoad(0, 1, 10))
    hashes_a = prompt_block_hashes(SYSTEM_A + [9] * 20, 16)
    assert view.matches(hashes_a, ["r1", "r2"]) == {"r1": 4.0, "r2": 0.0}
    assert view.loads() == {"r1": QueueLoad(0, 1, 10), "r2": None}
    cursor = (m.events.epoch, m.events.seq)
    m.free(1)
    m.allocate_slots(2, SYSTEM_B + [8] * 64, 128)  # all 8 blocks: A's are evicted
    view.apply("r1", batch_of(m, cursor), load=IDLE)
    assert view.matches(hashes_a, ["r1"]) == {"r1": 0.0}
    assert view.matches(prompt_block_hashes(SYSTEM_B, 16), ["r1"]) == {"r1": 4.0}
    assert view.num_held("r1") == len(m.gpu_pool.cached_block_hash_to_block) == 8


def test_leading_blocks_stop_at_the_first_miss_and_a_cpu_tier_counts_half():
    view = HoldingsView()
    view.retain(["r"])
    h = prompt_block_hashes(SYSTEM_A, 16)
    view.apply("r", KVEventBatch("e", 2, [(1, STORED, DEVICE, (h[0], h[2], h[3])),
                                          (2, STORED, CPU, (h[1],))], False), load=IDLE)
    assert view.matches(h, ["r"]) == {"r": 3.5}
    view.apply("r", KVEventBatch("e", 3, [(3, 1, CPU, (h[1],))], False), load=IDLE)  # evicted
    assert view.matches(h, ["r"]) == {"r": 1.0}


def test_just_routed_hashes_count_until_they_expire():
    now = [100.0]
    view = HoldingsView(recent_ttl_s=5.0, clock=lambda: now[0])
    view.retain(["r1", "r2"])
    h = prompt_block_hashes(SYSTEM_A, 16)
    view.note_routed("r2", h)
    assert view.matches(h, ["r1", "r2"]) == {"r1": 0.0, "r2": 4.0}
    assert view.sizes() == {"r1": 0, "r2": 4}
    now[0] += 5.5
    assert view.matches(h, ["r2"]) == {"r2": 0.0}


def test_a_replica_that_leaves_takes_its_holdings_and_late_answers_are_ignored():
    m = KVCacheManager(num_gpu_blocks=8, num_cpu_blocks=0, block_size=16)
    m.allocate_slots(1, SYSTEM_A, 64)
    view = HoldingsView()
    view.retain(["r1", "r2"])
    view.apply("r1", batch_of(m, (None, 0)), load=IDLE)
    view.retain(["r2", "r3"])  # Serve replaced r1
    h = prompt_block_hashes(SYSTEM_A, 16)
    assert view.matches(h, ["r1", "r2", "r3"]) == {"r1": 0.0, "r2": 0.0, "r3": 0.0}
    view.apply("r1", batch_of(m, (None, 0)), load=IDLE)  # an answer in flight when it died
    assert view.replica_ids() == ["r2", "r3"] and view.num_held("r1") == 0
    view.drop("r2")
    assert view.replica_ids() == ["r3"]


def test_a_restarted_engine_sends_a_snapshot_that_replaces_what_was_held():
    old = KVCacheManager(num_gpu_blocks=8, num_cpu_blocks=0, block_size=16)
    old.allocate_slots(1, SYSTEM_A, 64)
    view = HoldingsView()
    view.retain(["r"])
    view.apply("r", batch_of(old, (None, 0)), load=IDLE)
    new = KVCacheManager(num_gpu_blocks=8, num_cpu_blocks=0, block_size=16)  # new epoch
    new.allocate_slots(1, SYSTEM_B, 64)
    batch = new.events.since(*view.cursors()["r"])
    assert batch.snapshot
    view.apply("r", batch, load=IDLE)
    assert view.matches(prompt_block_hashes(SYSTEM_A, 16), ["r"]) == {"r": 0.0}
    assert view.matches(prompt_block_hashes(SYSTEM_B, 16), ["r"]) == {"r": 4.0}


def test_routing_cost_at_8_replicas_of_100k_blocks_is_under_a_millisecond():
    """The router's own work per request (choose_replicas): hash a 2,000-token prompt, score 8
    full replicas, count their queues (the reports, 64 requests routed since, those chosen)
    and rank."""
    rng = random.Random(0)
    router = new_router()
    ids = [f"r{i}" for i in range(8)]
    replicas = [_Replica(rid) for rid in ids]
    router.view.retain(ids)
    prompt = [rng.randrange(150_000) for _ in range(2000)]
    shared = prompt_block_hashes(prompt, 16)
    for i, rid in enumerate(ids):
        n = 100_000 - len(shared)
        raw = os.urandom(16 * n)
        filler = tuple(raw[j:j + 16] for j in range(0, 16 * n, 16))
        held = (tuple(shared[: 40 + 10 * i]) if i % 2 else ()) + filler
        router.view.apply(rid, KVEventBatch("e", 1, [(1, STORED, DEVICE, tuple(held))], False),
                          QueueLoad(2, 6, 500, frozenset(f"x{j}" for j in range(8))))
    times, first = [], []

    async def go() -> None:
        router.shared.task = asyncio.get_running_loop().create_future()  # no poller here
        # (inside the loop: a PendingRequest makes its future on the running loop)
        for i in range(64):
            router.on_request_routed(request(1000 + i, prompt[:100]),
                                     replicas[i % 8].replica_id, None)
        for i in range(50):
            t = time.perf_counter()
            ranks = await router.choose_replicas(replicas, request(i, prompt))
            times.append(time.perf_counter() - t)
            first.append((ranks[0][0].replica_id.unique_id, router.last_reason))

    try:
        asyncio.run(go())
    finally:
        SHARED.pop(router.shared_key)  # ~200 MB of hashes
    assert first[0] == ("r7", "prefix") and router.view.num_held("r7") == 100_000 - 125 + 110
    assert sorted(times)[len(times) // 2] < 1e-3  # the median; a busy shared machine adds noise


HASH_SCRIPT = ("from kvcache.hashing import prompt_block_hashes;"
               "print(b''.join(prompt_block_hashes(list(range(5000, 5100)), 16, b'salt')).hex())")


def test_block_hashes_are_equal_across_processes_whatever_the_hash_seed():
    outs = set()
    for seed in ("1", "2", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(subprocess.run([sys.executable, "-c", HASH_SCRIPT], env=env, check=True,
                                capture_output=True, text=True).stdout.strip())
    here = b"".join(prompt_block_hashes(list(range(5000, 5100)), 16, b"salt")).hex()
    assert outs == {here} and len(here) == 6 * 32


@pytest.mark.parametrize("key, value, message", [
    ("request_router", "round_robin", "request_router 'round_robin' is unknown; choose one of "
                                      "['prefix_aware', 'power_of_two']"),
    ("router_imbalance_abs", -1, "router_imbalance_abs must be an integer >= 0"),
    ("router_imbalance_rel", 0.5, "router_imbalance_rel must be a number >= 1.0"),
    ("router_session_hold_s", -1, "router_session_hold_s must be a number of seconds from 0"),
    ("router_session_hold_s", "5s", "router_session_hold_s must be a number of seconds from 0"),
])
def test_router_keys_fail_at_start_naming_the_choice(key, value, message):
    from cluster.api.serve_app import split_args

    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        split_args({"model": "qwen3-tiny", key: value})


def test_one_replica_gets_serves_default_router_and_two_get_the_prefix_aware_one():
    from cluster.api.prefix_router import PrefixAwareRouter, request_router_config
    from cluster.api.serve_app import split_args

    config, serving = split_args({"model": "qwen3-tiny"})
    assert request_router_config(serving, config.block_size) is None
    _, serving = split_args({"model": "qwen3-tiny", "num_replicas": 2})
    cfg = request_router_config(serving, 16)
    assert cfg.request_router_class is PrefixAwareRouter or cfg.request_router_class.endswith(
        "PrefixAwareRouter")
    assert cfg.request_router_kwargs == {"block_size": 16, "imbalance_abs": 8,
                                         "imbalance_rel": 1.5, "session_hold_s": 5.0}
    _, serving = split_args({"model": "qwen3-tiny", "autoscaling_config": {"max_replicas": 4}})
    assert request_router_config(serving, 16) is not None
    _, serving = split_args({"model": "qwen3-tiny", "num_replicas": 2,
                             "request_router": "power_of_two"})
    assert request_router_config(serving, 16) is None


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
])
def test_prompt_cache_key_must_be_a_string(engine, tokenizer, route, body):
    from fake_engine import fetch

    bad = fetch(engine, tokenizer, "POST", route, {**body, "prompt_cache_key": 42})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_cache_key"
    good = fetch(engine, tokenizer, "POST", route, {**body, "prompt_cache_key": "conv-1"})
    assert good.status_code == 200
    assert "x-replica-id" not in good.headers  # an engine in this process: no replica to name


class _Replica:
    """What the router reads of Serve's RunningReplica: its id."""

    def __init__(self, unique_id: str) -> None:
        from ray.serve._private.common import DeploymentID, ReplicaID

        self.replica_id = ReplicaID(unique_id, DeploymentID(name="LLMServer", app_name="t"))


_APPS = itertools.count()


def new_router(**kwargs):
    """A PrefixAwareRouter as Serve builds it, with a view of its own (a fresh app name)."""
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from cluster.api.prefix_router import PrefixAwareRouter

    app = f"t{next(_APPS)}"
    router = PrefixAwareRouter(deployment_id=DeploymentID(name="LLMServer", app_name=app),
                               handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(block_size=16, **kwargs)
    router.shared_key = (app, "LLMServer")
    return router


def request(i: int, tokens: list[int], key: str | None = None):
    """Serve's PendingRequest for LLMServer.generate(tokens, params, request_id, cache_salt)."""
    from ray.serve._private.common import RequestMetadata
    from ray.serve.request_router import PendingRequest

    return PendingRequest(args=[tokens, None, f"r{i}", None], kwargs={"routing_key": key},
                          metadata=RequestMetadata(f"r{i}", f"internal-{i}"))


def test_router_hooks_send_a_prefix_home_and_count_only_what_they_routed():
    """PrefixAwareRouter itself (no Serve): choose, routed, completed; broadcasts that Serve
    reports as completed (metrics, KV-event polls) do not lower a replica's load."""

    async def go() -> None:
        router = new_router()
        router.shared.task = asyncio.get_running_loop().create_future()  # no poller here
        a, b = _Replica("a"), _Replica("b")
        router.view.retain(["a", "b"])
        first = request(1, SYSTEM_A + [1] * 8)
        ranks = await router.choose_replicas([a, b], first)
        assert len(ranks) == 2 and len(ranks[0]) == 1  # nothing held: either, the other next
        home = ranks[0][0]
        router.on_request_routed(first, home.replica_id, None)
        other = b if home is a else a
        hid, oid = home.replica_id.unique_id, other.replica_id.unique_id
        router.on_request_completed(home.replica_id, "a-broadcast-to-every-replica")
        # no report yet: request 1 missed everything, its 72 prompt tokens are owed until it
        # completes; one more unrelated miss there, and one sharing request 1's 64-token prefix
        # is cheaper on the idle replica (144 owed > 2 x 64 saved)
        assert router.queued([hid, oid]) == ({hid: 1, oid: 0}, {hid: 72, oid: 0})
        router.on_request_routed(request(5, SYSTEM_B + [5] * 8), home.replica_id, None)
        meanwhile = await router.choose_replicas([a, b], request(2, SYSTEM_A + [2] * 8))
        assert meanwhile[0] == [other] and router.last_reason == "load"
        router.on_request_completed(home.replica_id, "internal-1")
        router.on_request_completed(home.replica_id, "internal-5")
        assert router.queued([hid]) == ({hid: 0}, {hid: 0})
        again = await router.choose_replicas([a, b], request(3, SYSTEM_A + [3] * 8))
        assert again[0] == [home] and router.last_reason == "prefix"
        router.on_replica_actor_died(home.replica_id)
        gone = await router.choose_replicas([other], request(4, SYSTEM_A))
        assert gone == [[other]] and router.view.replica_ids() == [oid]

    asyncio.run(go())


def test_queued_work_is_the_last_report_plus_what_was_routed_that_it_does_not_name():
    """The replica's own numbers (what other routers sent it too, prefills done) replace this
    router's estimate for every request the report names; the others count on top, once."""

    async def go() -> None:
        router = new_router()
        router.shared.task = asyncio.get_running_loop().create_future()  # no poller here
        a, b = _Replica("a"), _Replica("b")
        router.view.retain(["a", "b"])
        nothing = KVEventBatch("e", 0, [], False)
        router.on_request_routed(request(1, SYSTEM_A + [1] * 8), a.replica_id, None)
        router.on_request_routed(request(2, SYSTEM_B + [2] * 8), a.replica_id, None)
        # no report yet: each counts with its whole miss (72 tokens) until it completes
        assert router.queued(["a", "b"]) == ({"a": 2, "b": 0}, {"a": 144, "b": 0})
        # a's answer names request 1 (prefilled, decoding) and one from another router
        # (waiting, 200 prompt tokens past its cached prefix), not request 2 (not there yet)
        router.view.apply("a", nothing, QueueLoad(1, 1, 200, frozenset({"r1", "other"})))
        assert router.queued(["a", "b"]) == ({"a": 3, "b": 0}, {"a": 272, "b": 0})
        router.on_request_completed(a.replica_id, "internal-1")  # the report still counts it
        assert router.queued(["a"]) == ({"a": 3}, {"a": 272})
        # the next answer names request 2 and no longer request 1
        router.view.apply("a", nothing, QueueLoad(0, 2, 30, frozenset({"r2", "other"})))
        assert router.queued(["a", "b"]) == ({"a": 2, "b": 0}, {"a": 30, "b": 0})
        router.on_request_completed(a.replica_id, "internal-2")  # named: nothing changes
        assert router.queued(["a"]) == ({"a": 2}, {"a": 30})
        # chosen and not confirmed by Serve yet: counts at once, with what it misses there
        ranks = await router.choose_replicas([a, b], request(3, SYSTEM_A + [3] * 8))
        assert ranks[0] == [b] and router.queued(["a", "b"]) == ({"a": 2, "b": 1},
                                                                  {"a": 30, "b": 72})

    asyncio.run(go())


def test_a_burst_is_spread_and_grouped_before_serve_confirms_any_routing():
    """Serve confirms a routing (on_request_routed) only after a round trip to the replica and
    routes the next requests meanwhile: what the router chose counts as load and as held at
    once, so a burst of two prefixes puts each prefix on one replica, one per replica."""

    async def go() -> None:
        router = new_router()
        router.shared.task = asyncio.get_running_loop().create_future()  # no poller here
        a, b = _Replica("a"), _Replica("b")
        router.view.retain(["a", "b"])
        burst = [request(i, (SYSTEM_A if i % 2 == 0 else SYSTEM_B) + [i] * 8) for i in range(6)]
        homes = [(await router.choose_replicas([a, b], r))[0][0].replica_id.unique_id
                 for r in burst]
        assert homes[0] != homes[1], "the second prefix goes to the idle replica"
        assert homes[2::2] == [homes[0]] * 2 and homes[3::2] == [homes[1]] * 2
        assert router.queued(["a", "b"])[0] == {"a": 3, "b": 3}  # all chosen, none routed
        # Serve routes request 0 where chosen: it moves from chosen to routed, still counted
        router.on_request_routed(burst[0], a.replica_id if homes[0] == "a" else b.replica_id,
                                 None)
        assert len(router._chosen) == 5 and router.queued(["a", "b"])[0] == {"a": 3, "b": 3}
        router._chosen["cancelled"] = ("a", time.monotonic() - 31.0, 1)  # never routed
        assert router.queued(["a", "b"])[0] == {"a": 3, "b": 3}
        assert "cancelled" not in router._chosen

    asyncio.run(go())


def test_a_session_between_turns_counts_on_its_replica_so_its_next_turn_stays_home():
    """Nine sessions on each replica; all of a's but one are mid-turn while six of b's are
    thinking. Without the hold a looks overloaded (8 requests against 3: more than 4 more, the
    threshold here, and 1.5x) and the returning session spills to b, copying its prefix there;
    with it each replica counts its nine sessions (the returning one as itself) and the
    session stays."""

    async def go(hold: float) -> tuple[dict[str, int], str, str]:
        router = new_router(session_hold_s=hold, imbalance_abs=4)
        router.shared.task = asyncio.get_running_loop().create_future()  # no poller here
        a, b = _Replica("a"), _Replica("b")
        router.view.retain(["a", "b"])
        for i in range(18):
            replica = a if i < 9 else b
            router.on_request_routed(request(i, (SYSTEM_A if i < 9 else SYSTEM_B) + [i] * 8,
                                             key=f"s{i}"), replica.replica_id, None)
        for i in (0, 9, 10, 11, 12, 13, 14):  # their turns end; s0 comes back at once
            router.on_request_completed((a if i < 9 else b).replica_id, f"internal-{i}")
        loads = router.queued(["a", "b"])[0]
        ranks = await router.choose_replicas([a, b], request(100, SYSTEM_A + [0] * 24, "s0"))
        return loads, ranks[0][0].replica_id.unique_id, router.last_reason

    assert asyncio.run(go(5.0)) == ({"a": 9, "b": 9}, "a", "affinity")
    assert asyncio.run(go(0.0)) == ({"a": 8, "b": 3}, "b", "load")


def test_a_session_hold_ends_when_it_expires_or_its_replica_leaves():
    async def go() -> None:
        router = new_router(session_hold_s=0.2)
        router.shared.task = asyncio.get_running_loop().create_future()  # no poller here
        a, b = _Replica("a"), _Replica("b")
        router.view.retain(["a", "b"])
        for i, replica in enumerate((a, a, b)):
            router.on_request_routed(request(i, SYSTEM_A + [i] * 8, key=f"s{i}"),
                                     replica.replica_id, None)
            router.on_request_completed(replica.replica_id, f"internal-{i}")
        router.on_request_completed(a.replica_id, "internal-0")  # a second call: no change
        assert router.queued(["a", "b"])[0] == {"a": 2, "b": 1}
        router.on_replica_actor_died(b.replica_id)
        assert router.queued(["a", "b"])[0] == {"a": 2, "b": 0}
        await asyncio.sleep(0.25)
        assert router.queued(["a", "b"])[0] == {"a": 0, "b": 0}
        assert router.sessions.counts(time.monotonic(), {}) == {} and not router._key_of

    asyncio.run(go())


def test_a_turn_that_ended_after_the_last_report_was_asked_for_is_not_counted_twice():
    """The report answering a poll sent before a turn ended may still count that turn's
    request: its session's hold counts only against a report asked for after it ended."""
    from cluster.api.sessions import SessionHolds

    holds = SessionHolds(hold_s=5.0)
    holds.hold("s1", "a", now=10.0)
    holds.hold("s2", "a", now=10.2)
    holds.hold("s3", "b", now=10.1)
    holds.hold("s1", "b", now=10.3)  # s1's next turn ended on b: it is held there only
    assert holds.counts(10.4, {"a": 10.15, "b": None}) == {"a": 0, "b": 2}
    assert holds.counts(10.4, {"a": 10.25, "b": 10.2}) == {"a": 1, "b": 1}
    holds.end("s3")
    assert holds.counts(15.25, {"a": 11.0, "b": 11.0}) == {"b": 1}  # s2 expired at 15.2
    holds.retain(["a"])
    assert holds.counts(15.25, {}) == {}
    off = SessionHolds(hold_s=0.0)
    off.hold("s1", "a", now=1.0)
    assert off.counts(1.0, {}) == {}


def test_a_request_done_in_the_engine_but_still_streaming_counts_only_as_its_session():
    """A routed request that a report asked for well after its routing does not name has
    finished in the engine (its last tokens are still on their way out through the ingress):
    no prompt work and no request any more, but with a routing key its session is between
    turns and counts once, before and after Serve reports it completed."""

    async def go() -> None:
        router = new_router()
        router.shared.task = asyncio.get_running_loop().create_future()  # no poller here
        a = _Replica("a")
        router.view.retain(["a"])
        nothing = KVEventBatch("e", 0, [], False)
        router.on_request_routed(request(1, SYSTEM_A + [1] * 8, key="s1"), a.replica_id, None)
        router.on_request_routed(request(2, SYSTEM_B + [2] * 8), a.replica_id, None)
        router.on_request_routed(request(3, SYSTEM_B + [3] * 8), a.replica_id, None)
        asked = time.monotonic()
        # asked for at once: its silence about 1 and 2 proves nothing (they may not be there)
        router.view.apply("a", nothing, QueueLoad(0, 1, 0, frozenset({"r3"})), as_of=asked)
        assert router.queued(["a"]) == ({"a": 3}, {"a": 144})
        router.view.apply("a", nothing, QueueLoad(0, 1, 0, frozenset({"r3"})), as_of=asked + 1)
        assert router.queued(["a"]) == ({"a": 2}, {"a": 0})  # s1 between turns, and r3
        router.on_request_completed(a.replica_id, "internal-1")
        router.on_request_completed(a.replica_id, "internal-2")
        assert router.queued(["a"]) == ({"a": 2}, {"a": 0})  # s1 held, from now on by its key

    asyncio.run(go())
