"""PrefixAwareRouter: the Serve request router for LLMServer that routes by exact KV holdings.

Policy (`rank_replicas`, one screen, Ray Serve LLM's PrefixCacheAffinityRouter / SGLang's
cache_aware shape with exact block hashes instead of approximate text trees):
  1. Balance first: a replica with more than `imbalance_abs` requests more than the least
     loaded one and more than `imbalance_rel` times as many is overloaded; it goes last.
  2. Affinity: a request with a routing key (OpenAI's `prompt_cache_key`, else the
     `X-Session-Id` header) goes back to the replica its key last went to, unless that replica
     is overloaded: then it spills, and the key follows it. A session between turns still
     counts as one request on its replica for `session_hold_s` (5 s) after its last turn
     completed: a client thinking or a tool running will be back, so the guard weighs how many
     sessions each replica serves, not only which of them happen to be mid-turn (without the
     hold, one replica's sessions thinking at once made the other look overloaded, and a
     conversation spilled there, copying its system prompt into a second pool).
  3. Least prompt work: among the others, the replica with the fewest prompt tokens to compute
     before this request's first token: those it already owes (`work`, below) plus what this
     request misses there (its prompt past the leading blocks that replica holds: the chained
     xxh3 hashes of kvcache/hashing.py over the prompt the ingress tokenized, with the
     request's cache salt), a held token counting PREFIX_WEIGHT (2) times: it saves its
     compute and a second copy in another pool. So a prefix goes home unless its home owes
     more than twice what recomputing it elsewhere costs. A request under a LoRA adapter
     hashes with the adapter's `cache_key` (the engine's extra key) and counts ADAPTER_TOKENS less on
     a replica that has the adapter loaded; overloaded holders are skipped like any other, so
     a hot adapter spreads to a replica that loads it instead of queueing. Among equals: fewer
     requests, then the emptier cache, then random.
The others follow, least loaded first, so Serve falls through to them when the first refuses
(max_ongoing_requests).

Load and work (`queued`): what the replica reported with its last poll answer (its engine's
`QueueLoad`: requests waiting and running, and the prompt tokens they still owe, i.e. a
waiting request's prompt past what the prefix cache holds now or a request ahead of it
computes first, and a running prefill's uncomputed part; so what other routers sent it counts
too, and a request's work stops counting once its prefill is done), plus each request this
router routed there that the report does not name (its request ids: routed after the replica
answered, or not arrived yet; each counts its prompt past what the replica held when chosen;
one routed more than ARRIVAL_S before the report's poll was sent and not named by it has
finished in the engine and is only streaming its last tokens out: it counts nothing, or, with
a routing key, one request for its session between turns),
plus what it chose and Serve has not confirmed yet (Serve confirms a routing only after a
round trip to the replica, and routes the next requests of a burst meanwhile). So a burst
counts at once, and a request counts once. Staleness: the report is as of when the replica
answered, at most one poll period plus one round trip old (0.25 s; 1 s after 5 s without
routing); for that long a request that finished (or finished its prefill) still counts: an
over-count only. A replica that has not answered yet (or misses polls) counts every request
this router routed there and that has not completed, with its whole miss. One candidate:
taken as it is, nothing hashed.

Holdings (kv_holdings.py): every `poll_period_s` (0.25 s) a task in the router's process calls
`LLMServer.kv_events` on every replica with Serve's `DeploymentHandle.broadcast`, passing each
replica's cursor; each answers with its `KVEventLog` entries since then (kvcache/events.py;
stored and evicted hashes in order, batched by the polling) and its `QueueLoad`, in the same
answer. So the view is at most one period plus one round trip old (after 5 s without routing
a request the period is 1 s; Serve's routing-stats period, 10 s, is not used), and the hashes
this router just chose a replica for count as held there meanwhile. A replica that Serve drops
or reports dead loses its holdings and its report at once; a restarted engine answers with a
snapshot (new epoch). Per request the router hashes the prompt once, walks each replica's
leading blocks in set lookups, stopping at the first miss, and looks up the requests it has
in flight in each replica's report (set lookups); docs/benchmarks.md has the measured time.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from cluster.api import kv_holdings
from cluster.api.kv_holdings import DEFAULT_RECENT_TTL_S
from cluster.api.sessions import SessionHolds
from kvcache.hashing import BlockHash, extra_key, prompt_block_hashes
from scheduler.outputs import QueueLoad

logger = logging.getLogger("ray.serve")

DEFAULT_POLL_PERIOD_S = 0.25
# After this long without routing a request, poll once a second: an idle deployment's replicas
# are not asked eight times a second for what has not changed.
IDLE_AFTER_S, IDLE_POLL_PERIOD_S = 5.0, 1.0
MAX_ROUTING_KEYS = 100_000  # affinity entries kept, least recently used dropped first
DEFAULT_SESSION_HOLD_S = 5.0  # a session between turns counts as load this long
ARRIVAL_S = 0.1  # a request routed this long before a poll was sent is in its answer if running
CHOSEN_TTL_S = 30.0  # a chosen request not routed by then was cancelled: it stops counting
# A prompt token held on a replica saves computing it there now and, sent elsewhere, a second
# copy of it in another pool, which evicts something that is recomputed later once pools are
# full: each counts twice against prompt tokens owed (docs/benchmarks.md, issue #24, round 3).
PREFIX_WEIGHT = 2.0
# A replica that has a request's LoRA adapter loaded saves loading it (and keeps each adapter's
# requests, and their KV, together): worth this many prompt tokens owed.
ADAPTER_TOKENS = 128


@dataclass(frozen=True, slots=True)
class RoutingThresholds:
    """When a replica counts as overloaded against the least loaded one (both must hold)."""

    imbalance_abs: int = 8  # requests more than the least loaded replica
    imbalance_rel: float = 1.5  # times the least loaded replica's requests

    def overloaded(self, load: int, least: int) -> bool:
        return load - least > self.imbalance_abs and load > self.imbalance_rel * least


def rank_replicas(replica_ids: Sequence[str], loads: dict[str, int], matches: dict[str, float],
                  affinity: str | None, th: RoutingThresholds, rng: random.Random,
                  sizes: dict[str, int] | None = None, work: dict[str, int] | None = None,
                  block_size: int = 16,
                  adapter: set[str] | None = None) -> tuple[list[str], str]:
    """Replica ids best first and why the first one (the module docstring's policy): loads in
    requests, matches in leading blocks held, sizes in blocks cached, work in prompt tokens,
    `adapter` the replicas holding the request's LoRA adapter."""
    sizes, work, adapter = sizes or {}, work or {}, adapter or set()
    by_load = sorted(replica_ids,
                     key=lambda r: (loads.get(r, 0), sizes.get(r, 0), rng.random()))
    least = loads.get(by_load[0], 0)
    fit = [r for r in by_load if not th.overloaded(loads.get(r, 0), least)]

    def first(r: str) -> list[str]:
        return [r] + [x for x in fit if x != r] + [x for x in by_load if x not in fit]

    if affinity in fit and affinity in replica_ids:
        return first(affinity), "affinity"

    def cost(r: str) -> float:  # prompt work before this request's first token, less a constant
        return (work.get(r, 0) - matches.get(r, 0.0) * block_size * PREFIX_WEIGHT
                - (ADAPTER_TOKENS if r in adapter else 0))

    best = min(fit, key=cost)  # the first among equals in by_load order
    if cost(min(by_load, key=cost)) < cost(best):
        return first(best), "balance"  # an overloaded replica would have been cheaper
    return first(best), ("prefix" if matches.get(best, 0.0) > 0.0
                         else "adapter" if best in adapter else "load")


class PrefixAwareRouter(RequestRouter):
    """Serve's request router for LLMServer (module docstring); kwargs from the manifest.

    Not FIFOMixin: a replica chosen for a request's blocks must go to that request (Serve's
    base router matches the internal request id), not to the oldest one waiting.
    """

    def initialize_state(self, block_size: int = 16, imbalance_abs: int = 8,
                         imbalance_rel: float = 1.5,
                         poll_period_s: float = DEFAULT_POLL_PERIOD_S,
                         recent_ttl_s: float = DEFAULT_RECENT_TTL_S,
                         session_hold_s: float = DEFAULT_SESSION_HOLD_S, **_: Any) -> None:
        self.block_size = block_size
        self.thresholds = RoutingThresholds(imbalance_abs, imbalance_rel)
        self.poll_period_s = poll_period_s
        key = (self._deployment_id.app_name, self._deployment_id.name)
        # Through the module, not a name of this one: Serve pickles this module by value
        # (RequestRouterConfig), which would copy a global dict and whatever it holds.
        self.shared = kv_holdings.SHARED.setdefault(key, kv_holdings.Shared(recent_ttl_s))
        self.view = self.shared.view
        # replica -> internal request id -> (engine request id, its work there, when routed),
        # for requests this router routed and that have not completed (Serve also reports
        # broadcasts, e.g. the metrics and KV-event polls, as completed requests: not here).
        self._routed: dict[str, dict[str, tuple[str | None, int, float]]] = {}
        self._routed_to: dict[str, str] = {}  # internal request id -> its replica
        self.routing_keys: OrderedDict[str, str] = OrderedDict()
        self.sessions = SessionHolds(session_hold_s)
        self._key_of: dict[str, str] = {}  # internal request id -> its routing key, in flight
        self._hashes: dict[str, list[BlockHash]] = {}  # internal request id -> prompt hashes
        # internal request id -> (replica chosen, when, its work there): chosen, not routed
        # yet. Serve calls on_request_routed only once the replica has accepted (a round
        # trip), and meanwhile routes the next requests: these count as load and their hashes
        # as held already.
        self._chosen: dict[str, tuple[str, float, int]] = {}
        self._rng = random.Random()
        self.last_reason = ""

    # ---- Serve's hooks ---------------------------------------------------------------------

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        ids = [r.replica_id.unique_id for r in replicas]
        self.view.retain(ids)
        self._routed = {r: self._routed.get(r, {}) for r in ids}
        self.sessions.retain(ids)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.view.drop(replica_id.unique_id)
        for internal_id in self._routed.pop(replica_id.unique_id, {}):
            self._routed_to.pop(internal_id, None)
            self._key_of.pop(internal_id, None)
        self.sessions.retain(self._routed)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if len(candidate_replicas) <= 1:
            return [candidate_replicas] if candidate_replicas else []
        self._ensure_poller()
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        ids = list(by_id)
        hashes = self._prompt_hashes(pending_request)
        matches = self.view.matches(hashes, ids) if hashes else {}
        key = _routing_key(pending_request)
        if key is not None:  # its turn has come: it counts as this request from now on
            self.sessions.end(key)
        loads, work = self.queued(ids, pending_request)
        affinity = self.routing_keys.get(key) if key is not None else None
        lora = _lora_name(pending_request)
        holders = self.view.holding_adapter(lora, ids) if lora is not None else None
        ranked, self.last_reason = rank_replicas(ids, loads, matches, affinity, self.thresholds,
                                                 self._rng, self.view.sizes(), work,
                                                 self.block_size, holders)
        if pending_request is not None:
            held = int(matches.get(ranked[0], 0.0) * self.block_size)
            self._chosen[pending_request.metadata.internal_request_id] = (
                ranked[0], time.monotonic(), max(1, self._prompt_len(pending_request) - held))
            if hashes:
                self.view.note_routed(ranked[0], hashes)
            if lora is not None:
                self.view.note_adapter(ranked[0], lora)
            if key is not None:  # the next turn of this session follows before this one lands
                self._remember_key(key, ranked[0])
        return [[by_id[ranked[0]]], [by_id[r] for r in ranked[1:]]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        rid = replica_id.unique_id
        internal_id = pending_request.metadata.internal_request_id
        self.shared.last_routed = time.monotonic()
        chosen = self._chosen.pop(internal_id, None)
        # Sent elsewhere than chosen (Serve fell through): count its whole prompt there.
        cost = chosen[2] if chosen is not None and chosen[0] == rid else \
            self._prompt_len(pending_request)
        self._routed_to[internal_id] = rid
        self._routed.setdefault(rid, {})[internal_id] = (_request_id(pending_request), cost,
                                                         time.monotonic())
        hashes = self._hashes.pop(internal_id, None)
        if hashes and (chosen is None or chosen[0] != rid):  # Serve fell through to another
            self.view.note_routed(rid, hashes)
        key = _routing_key(pending_request)
        if key is not None:
            self._remember_key(key, rid)
            self._key_of[internal_id] = key

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._hashes.pop(internal_request_id, None)
        self._chosen.pop(internal_request_id, None)
        rid = self._routed_to.pop(internal_request_id, None)
        entry = self._routed[rid].pop(internal_request_id, None) if rid in self._routed else None
        key = self._key_of.pop(internal_request_id, None)
        if key is not None and entry is not None:
            # Already counted as between turns (the queued docstring): it goes on counting.
            done = _finished_in_engine(entry, self.view.loads().get(rid),
                                       self.view.reported_at().get(rid))
            self.sessions.hold(key, rid, time.monotonic(), counted=done)

    # ---- internals -------------------------------------------------------------------------

    def queued(self, ids: Sequence[str], pending: PendingRequest | None = None
               ) -> tuple[dict[str, int], dict[str, int]]:
        """Per replica the requests and the prompt tokens queued there (the module docstring):
        its last report, what this router routed there that the report does not hold, and
        what it chose for it and Serve has not confirmed (not `pending` itself, which Serve
        may route again after a refusal; entries older than CHOSEN_TTL_S are dropped: a
        request cancelled while Serve routed it gets no completion); the requests count the
        sessions held between turns there (SessionHolds.counts; no prompt tokens: they owe
        none yet)."""
        reports, since = self.view.loads(), self.view.reported_at()
        loads: dict[str, int] = {}
        work: dict[str, int] = {}
        for r in ids:
            report = reports.get(r)
            loads[r] = report.num_waiting + report.num_running if report else 0
            work[r] = report.prompt_tokens if report else 0
            named = report.request_ids if report is not None else frozenset()
            for internal_id, entry in self._routed.get(r, {}).items():
                if entry[0] in named:
                    continue  # the report counts it
                if not _finished_in_engine(entry, report, since.get(r)):
                    loads[r] += 1
                    work[r] += entry[1]
                elif internal_id in self._key_of:  # its session is between turns
                    loads[r] += 1
        now = time.monotonic()
        for r, held in self.sessions.counts(now, since).items():
            if r in loads:
                loads[r] += held
        own = pending.metadata.internal_request_id if pending is not None else None
        stale = now - CHOSEN_TTL_S
        for rid, (replica, when, cost) in list(self._chosen.items()):
            if when < stale:
                del self._chosen[rid]
            elif rid != own and replica in loads:
                loads[replica] += 1
                work[replica] += cost
        return loads, work

    @staticmethod
    def _prompt_len(pr: PendingRequest | None) -> int:
        args = pr.args if pr is not None else None
        return len(args[0]) if args and isinstance(args[0], list) else 0

    def _remember_key(self, key: str, replica: str) -> None:
        self.routing_keys[key] = replica
        self.routing_keys.move_to_end(key)
        if len(self.routing_keys) > MAX_ROUTING_KEYS:
            self.routing_keys.popitem(last=False)

    def _prompt_hashes(self, pr: PendingRequest | None) -> list[BlockHash]:
        """The request's prompt block hashes, computed once per request (Serve may ask again)."""
        if pr is None or not pr.args or not isinstance(pr.args[0], list):
            return []
        rid = pr.metadata.internal_request_id
        hashes = self._hashes.get(rid)
        if hashes is None:
            if len(self._hashes) >= MAX_ROUTING_KEYS:  # requests cancelled while routing
                self._hashes.clear()
            salt = pr.args[3] if len(pr.args) > 3 else pr.kwargs.get("cache_salt")
            lora = pr.kwargs.get("lora_request")
            hashes = prompt_block_hashes(pr.args[0], self.block_size,  # (the engine's key)
                                         extra_key(salt, lora.cache_key if lora else None))
            self._hashes[rid] = hashes
        return hashes

    def _ensure_poller(self) -> None:
        task = self.shared.task
        if task is None or task.done():
            self.shared.task = asyncio.get_running_loop().create_task(
                poll_holdings(self.shared, self._deployment_id.app_name,
                              self._deployment_id.name, self.poll_period_s))


def _finished_in_engine(entry: tuple[str | None, int, float], report: QueueLoad | None,
                        since: float | None) -> bool:
    """Whether a replica's report, answering a poll sent at `since`, shows a routed request
    (engine request id, work, when routed) done: asked for more than ARRIVAL_S after its
    routing, and not naming it."""
    return (report is not None and since is not None and entry[2] < since - ARRIVAL_S
            and entry[0] not in report.request_ids)


def _routing_key(pr: PendingRequest | None) -> str | None:
    return pr.kwargs.get("routing_key") if pr is not None else None


def _lora_name(pr: PendingRequest | None) -> str | None:
    lora = pr.kwargs.get("lora_request") if pr is not None else None
    return getattr(lora, "lora_name", None)


def _request_id(pr: PendingRequest) -> str | None:
    """The engine's request id: LLMServer.generate(prompt, params, request_id, ...)."""
    args = pr.args
    return args[2] if len(args) > 2 and isinstance(args[2], str) else pr.kwargs.get("request_id")


async def poll_holdings(shared: kv_holdings.Shared, app_name: str, deployment: str,
                        period_s: float) -> None:
    """Feed the view from every replica's `kv_events` each period (the module docstring)."""
    from ray import serve

    view = shared.view
    handle = serve.get_deployment_handle(deployment, app_name)
    while True:
        idle = time.monotonic() - shared.last_routed > IDLE_AFTER_S
        await asyncio.sleep(max(period_s, IDLE_POLL_PERIOD_S) if idle else period_s)
        if len(view.replica_ids()) < 2:
            continue
        sent = time.monotonic()
        try:
            answers = await handle.broadcast("kv_events", view.cursors()).results_async(
                timeout_s=max(2.0, 4 * period_s), return_exceptions=True)
        except Exception as e:  # noqa: BLE001 - the next period retries; routing goes on
            logger.debug("polling KV holdings failed: %s", e)
            continue
        for answer in answers:
            if not isinstance(answer, BaseException):
                view.apply(*answer, as_of=sent)


# The manifest's `request_router` names; None picks prefix_aware when the deployment can run
# more than one replica, else Serve's default (one replica has nothing to choose).
ROUTERS = ("prefix_aware", "power_of_two")


def check_router_args(serving: dict[str, Any]) -> None:
    """ValueError naming what to change in the manifest's router keys."""
    name = serving["request_router"]
    if name is not None and name not in ROUTERS:
        raise ValueError(f"request_router {name!r} is unknown; choose one of {list(ROUTERS)} "
                         "(or leave it out: prefix_aware when num_replicas or max_replicas > 1)")
    absolute, rel = serving["router_imbalance_abs"], serving["router_imbalance_rel"]
    if isinstance(absolute, bool) or not isinstance(absolute, int) or absolute < 0:
        raise ValueError(f"router_imbalance_abs must be an integer >= 0 (requests); got {absolute!r}")
    if isinstance(rel, bool) or not isinstance(rel, (int, float)) or rel < 1.0:
        raise ValueError(f"router_imbalance_rel must be a number >= 1.0 (times); got {rel!r}")
    hold = serving["router_session_hold_s"]
    if isinstance(hold, bool) or not isinstance(hold, (int, float)) or not 0 <= hold <= 3600:
        raise ValueError("router_session_hold_s must be a number of seconds from 0 (off) to "
                         f"3600; got {hold!r}")


def request_router_config(serving: dict[str, Any], block_size: int) -> Any | None:
    """Serve's RequestRouterConfig for LLMServer, or None for Serve's default router."""
    from ray.serve.config import RequestRouterConfig

    name = serving["request_router"]
    if name is None:
        autoscaling = serving["autoscaling_config"] or {}
        most = autoscaling.get("max_replicas", 1) if autoscaling else serving["num_replicas"]
        name = "prefix_aware" if isinstance(most, int) and most > 1 else "power_of_two"
    if name == "power_of_two":
        return None
    return RequestRouterConfig(
        request_router_class=PrefixAwareRouter,
        request_router_kwargs={"block_size": block_size,
                               "imbalance_abs": serving["router_imbalance_abs"],
                               "imbalance_rel": float(serving["router_imbalance_rel"]),
                               "session_hold_s": float(serving["router_session_hold_s"])})
