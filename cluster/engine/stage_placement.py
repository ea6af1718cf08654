"""Where a replica's worker ranks go: one STRICT_PACK placement group per pipeline stage.

A stage's `tensor_parallel_size` ranks share one node (their collectives are the chatty
ones); the stages of a pipeline-parallel replica may land on different nodes (they exchange
one step's hidden states). Stage 0 is the Serve replica's own placement group from
`bundle_offset` when it has one (`replica_placement: pack`), else a group soft-targeting the
node of this process (the replica's), as with a single stage; the later stages' groups go
wherever Ray finds room. Groups this module made are removed with `remove()`.

After a stage's node died, a rebuild waits for its group to be placed again
(`wait_placed`) for REBUILD_PLACEMENT_WAIT_S at most, then gives up with StagesUnplacedError.
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

    def wait_placed(self, timeout_s: float = REBUILD_PLACEMENT_WAIT_S) -> None:
        """Until every group's bundles are placed (state CREATED): after a node died, Ray
        moves its bundles to a node with room (RESCHEDULING) and a rank started before that
        is cancelled. StagesUnplacedError after `timeout_s`, or at once for a group that was
        removed (its owner's job or node died: it is never placed again)."""
        from ray.util import placement_group_table

        deadline = time.monotonic() + timeout_s
        while True:
            states = [placement_group_table(g).get("state") for g in self.groups]
            if all(s == "CREATED" for s in states):
                return
            if "REMOVED" in states:
                raise StagesUnplacedError(
                    f"the engine's placement groups are {states}: a removed group is never "
                    "placed again (the job or node of the process that made it died)")
            if time.monotonic() > deadline:
                raise StagesUnplacedError(
                    f"the engine's placement groups are {states}, not placed within "
                    f"{timeout_s:.0f} s of a rank's death: no node has room for a lost stage; "
                    "free or add a node")
            time.sleep(0.2)

    def remove(self) -> None:
        """Remove the groups this executor made (not the Serve replica's own); idempotent."""
        from ray.util.placement_group import remove_placement_group

        for group, owned in zip(self.groups, self.owned):
            if owned:
                with contextlib.suppress(Exception):  # removed with its job already
                    remove_placement_group(group)
        self.groups, self.offsets, self.owned = [], [], []


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
