"""Where a replica's worker ranks go: one STRICT_PACK placement group per pipeline stage.

A stage's `tensor_parallel_size` ranks share one node (their collectives are the chatty
ones); the stages of a pipeline-parallel replica may land on different nodes (they exchange
one step's hidden states). Stage 0 is the Serve replica's own placement group from
`bundle_offset` when it has one (`replica_placement: pack`), else a group soft-targeting the
node of this process (the replica's), as with a single stage; the later stages' groups go
wherever Ray finds room. Groups this module made are removed with `remove()`.

After a stage's node died, a rebuild waits for its group to be placed again (`wait_placed`).
It tells "no room" from "not yet": past REBUILD_PLACEMENT_WAIT_S it gives up
(StagesUnplacedError) unless some alive node has the unplaced group's resources free, in which
case Ray is only slow to move the group there and the wait goes on, to PLACEMENT_TIMEOUT_S.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

# How long an engine waits for its ranks' placement groups before it fails to start.
PLACEMENT_TIMEOUT_S = 120
# How long a rebuild waits for a lost stage's group to be placed again. When some node has
# room, Ray's GCS moves the group there within a second or two of declaring the old node dead
# (the rebuild's first attempt has already waited that declaration out); a group still
# unplaced after this has no node with room, and only a new node (an autoscaler's: minutes)
# would place it. Meanwhile the replica's streams stall, while the ingress's failover resumes
# them on another replica in seconds once the engine is dead (cluster/api/failover.py): so
# the engine gives up after this, with headroom for a GCS slow under load.
REBUILD_PLACEMENT_WAIT_S = 20.0


class StagesUnplacedError(RuntimeError):
    """A rebuild found no room for its stages' placement groups within the wait."""


@dataclass(slots=True)
class StagePlacement:
    """Each stage's placement group, the bundle index of its first rank, and whether it is
    this executor's to remove."""

    groups: list[Any]
    offsets: list[int]
    owned: list[bool]
    tp: int

    def strategy(self, rank: int) -> Any:
        """The scheduling strategy of global rank `rank` (stage rank // tp, bundle rank % tp)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        stage = rank // self.tp
        return PlacementGroupSchedulingStrategy(
            placement_group=self.groups[stage],
            placement_group_bundle_index=self.offsets[stage] + rank % self.tp)

    def wait_placed(self, timeout_s: float = REBUILD_PLACEMENT_WAIT_S,
                    room_timeout_s: float = PLACEMENT_TIMEOUT_S) -> None:
        """Until every group's bundles are placed (state CREATED): after a node died, Ray
        moves its bundles to a node with room (RESCHEDULING) and a rank started before that
        is cancelled. StagesUnplacedError at once for a group that was removed (its owner's
        job or node died: it is never placed again); after `timeout_s` when no alive node has
        room for an unplaced group; after `room_timeout_s` in any case."""
        from ray.util import placement_group_table

        start = time.monotonic()
        while True:
            tables = [placement_group_table(g) for g in self.groups]
            states = [t.get("state") for t in tables]
            if all(s == "CREATED" for s in states):
                return
            if "REMOVED" in states:
                raise StagesUnplacedError(
                    f"the engine's placement groups are {states}: a removed group is never "
                    "placed again (the job or node of the process that made it died)")
            waited = time.monotonic() - start
            if waited > timeout_s:
                free = _available_per_node()
                unplaced = [list(t.get("bundles", {}).values())
                            for t, s in zip(tables, states) if s != "CREATED"]
                roomy = free is not None and all(room_for(b, free) for b in unplaced)
                if not roomy:
                    raise StagesUnplacedError(
                        f"the engine's placement groups are {states}, not placed within "
                        f"{timeout_s:.0f} s of a rank's death, and no alive node has room for "
                        f"a lost stage (its bundles {unplaced}; free per node {free}); free or "
                        "add a node")
                if waited > room_timeout_s:
                    raise StagesUnplacedError(
                        f"the engine's placement groups are {states}, not placed within "
                        f"{room_timeout_s:.0f} s of a rank's death although a node has room "
                        f"(bundles {unplaced}; free per node {free})")
            time.sleep(0.2)

    def remove(self) -> None:
        """Remove the groups this executor made (not the Serve replica's own); idempotent."""
        from ray.util.placement_group import remove_placement_group

        for group, owned in zip(self.groups, self.owned):
            if owned:
                with contextlib.suppress(Exception):  # removed with its job already
                    remove_placement_group(group)
        self.groups, self.offsets, self.owned = [], [], []


def room_for(bundles: list[dict[str, float]], free: dict[str, dict[str, float]]) -> bool:
    """Whether one node of `free` (node id -> its available resources) has every resource
    the STRICT_PACK `bundles` need together. Ray's per-group resources (`CPU_group_...`) are
    a placed group's own, not room."""
    need: dict[str, float] = {}
    for bundle in bundles:
        for name, amount in bundle.items():
            need[name] = need.get(name, 0.0) + amount
    return any(all(avail.get(name, 0.0) >= amount - 1e-9 for name, amount in need.items())
               for avail in free.values())


def _available_per_node() -> dict[str, dict[str, float]] | None:
    """Each alive node's available resources (Ray's DeveloperAPI); None when Ray cannot say.

    The GCS's available view can lag its node table: a node that ray.nodes() has alive may be
    missing from it for a while (seen after a node was killed, on a loaded host). Such a node
    counts with its total resources, i.e. as possibly free: the wait then goes on (to
    `room_timeout_s`) instead of giving up on a node that may have room. A node the view still
    holds after it died is dropped."""
    try:
        import ray
        from ray._private.state import available_resources_per_node

        alive = {n["NodeID"]: n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")}
        view = available_resources_per_node()
        return {node: {k: v for k, v in view.get(node, total).items() if "_group_" not in k}
                for node, total in alive.items()}
    except Exception:  # noqa: BLE001 — then the wait gives up as if no node had room
        return None


def place_stages(pp: int, tp: int, bundle: dict[str, float], placement_group: Any = None,
                 bundle_offset: int = 0) -> StagePlacement:
    """Placement groups for `pp` stages of `tp` ranks of `bundle` each, ready; RuntimeError
    naming the bundles when they find no room within PLACEMENT_TIMEOUT_S."""
    import ray
    from ray.util.placement_group import placement_group as make_pg

    here = ray.get_runtime_context().get_node_id()
    placement = StagePlacement([], [], [], tp)
    for stage in range(pp):
        if stage == 0 and placement_group is not None:
            group, offset, owned = placement_group, bundle_offset, False
        else:
            # (stage 0: on this process's node when it has room, elsewhere when it has not)
            group = make_pg([bundle] * tp, strategy="STRICT_PACK",
                            _soft_target_node_id=here if stage == 0 else None)
            offset, owned = 0, True
        placement.groups.append(group)
        placement.offsets.append(offset)
        placement.owned.append(owned)
    try:
        ray.get([g.ready() for g in placement.groups], timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        bundles = placement.groups[0].bundle_specs if pp == 1 else [bundle] * tp
        placement.remove()  # (a pending group would take the room once some is freed)
        where = ("STRICT_PACK: all on one node" if pp == 1 else
                 f"per stage, STRICT_PACK: each of the {pp} stages on one node")
        raise RuntimeError(
            f"the {pp * tp} rank(s) of this engine found no node with room for them together "
            f"within {PLACEMENT_TIMEOUT_S} s (bundles {bundles}, {where}); free or add a node, "
            "or lower worker_num_cpus") from None
    return placement
