"""LoRA adapters as the scheduler sees them: a request's adapter (`LoRARequest`) and which
adapter sits in which device slot (`LoRASlots`).

The workers hold `max_loras` adapters in device slot tensors (workers/lora/); a sequence's
rows index its adapter's slot. The scheduler decides the slots, so every rank agrees:

- an adapter with a running request is resident and pinned (`users > 0`): its slot never
  changes while any of its requests runs, so a sequence's slot, sent once in its `NewSeq`,
  stays right until the workers drop the sequence;
- a resident adapter no running request uses is in `lru` (least recently released first)
  and may be evicted to load another one;
- at most `max_loras` adapters are resident, so a step never mixes more distinct adapters
  than there are slots. A request whose adapter finds no slot (every slot pinned) is not
  admitted: it waits at the head of its queue, so it is the next one admitted once a slot is
  released (never starved; requests behind it wait too, as FCFS does for KV blocks).

A slot load is a `LoRALoad` in the next plan (scheduler/plan.py): the engine attaches the
adapter's tensors from its host cache (cluster/engine/lora.py) before the plan goes out.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from scheduler.plan import LoRALoad


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """vLLM's `LoRARequest(lora_name, lora_int_id, lora_path)`: a PEFT adapter directory.

    `lora_int_id` (>= 1) identifies the adapter within an engine; name and id together
    (`cache_key`) identify it in the prefix cache's block hashes (kvcache/hashing.py), so two
    adapters never share KV, not even one loaded under a name another had before (a server
    gives it another id, cluster/api/lora_models.py).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string; "
                             f"got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an integer >= 1 (0 is the base "
                             f"model); got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest.lora_path must be the adapter's directory; "
                             f"got {self.lora_path!r}")

    @property
    def cache_key(self) -> str:
        """What the block hashes carry for this adapter (kvcache.hashing.extra_key)."""
        return f"{self.lora_name}\0{self.lora_int_id}"


class LoRASlots:
    """Device slots of adapters: residency, pins by running requests, LRU eviction."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.reset()

    def reset(self) -> None:
        """Nothing resident (start-up, or the workers were rebuilt with empty slots)."""
        self.slot_of: dict[int, int] = {}  # resident lora_int_id -> slot
        self.users: dict[int, int] = {}  # resident lora_int_id -> running requests using it
        self.lru: OrderedDict[int, None] = OrderedDict()  # resident, unused, oldest first
        self.free = list(range(self.max_loras - 1, -1, -1))
        self.loads: list[LoRALoad] = []  # the next plan's

    def can_place(self, lora_id: int) -> bool:
        """Whether `lora_id` is resident or can be made so now (a free slot, or an unused
        adapter to evict)."""
        return lora_id in self.slot_of or bool(self.free) or bool(self.lru)

    def place(self, lora_id: int) -> int:
        """Make `lora_id` resident (loading it in the next plan, evicting the least recently
        used unused adapter if no slot is free) and return its slot. Needs can_place."""
        slot = self.slot_of.get(lora_id)
        if slot is not None:
            return slot
        if self.free:
            slot = self.free.pop()
        else:
            victim, _ = self.lru.popitem(last=False)
            slot = self.slot_of.pop(victim)
            del self.users[victim]
            self.loads = [load for load in self.loads if load.slot != slot]
        self.slot_of[lora_id] = slot
        self.users[lora_id] = 0
        self.lru[lora_id] = None
        self.loads.append(LoRALoad(slot, lora_id))
        return slot

    def pin(self, lora_id: int) -> None:
        """A request of this (resident) adapter starts running."""
        self.users[lora_id] += 1
        self.lru.pop(lora_id, None)

    def unpin(self, lora_id: int) -> None:
        """A request of this adapter stops running (preempted, finished or aborted)."""
        self.users[lora_id] -= 1
        if self.users[lora_id] == 0:
            self.lru[lora_id] = None

    def take_loads(self) -> list[LoRALoad]:
        loads, self.loads = self.loads, []
        return loads

    def check(self) -> None:
        """Assert the invariants of the module docstring (tests)."""
        assert len(self.slot_of) <= self.max_loras
        assert len(self.slot_of) + len(self.free) == self.max_loras
        assert len(set(self.slot_of.values())) == len(self.slot_of)
        assert set(self.slot_of.values()).isdisjoint(self.free)
        assert set(self.lru) == {i for i, n in self.users.items() if n == 0}
        assert all(n >= 0 for n in self.users.values())
