"""Random interleavings of every manager operation against a tiny pool.

Besides check_invariants, the machine simulates KV memory: each block slot holds the token
whose KV it would hold. Allocation "writes" the new tokens (after applying copy-on-write
pairs), swaps copy block contents, and after every step each sequence's table must read back
exactly its token ids. That catches a missing copy-on-write, a referenced block handed out
again, a prefix hit on wrong KV, or a swap that loses or mixes blocks. With a CPU offload
tier, each operation is a step: its offloads and loads (take_transfers) are applied as the
workers would, before the step writes any KV, and a tier hit must hold the prompt's tokens.
"""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvcache import KVCacheManager

BS = 2
SYSTEM = [7, 8, 9, 10, 11, 12]  # a shared system prompt makes prefix hits common
tokens_st = st.lists(st.integers(1, 3), min_size=1, max_size=7)  # tiny alphabet: many repeats


class KVCacheMachine(RuleBasedStateMachine):
    @initialize(
        gpu=st.integers(4, 14), cpu=st.integers(0, 8), caching=st.booleans(),
        watermark=st.sampled_from([0.0, 0.1]), offload=st.sampled_from([0, 2, 6]),
    )
    def setup(self, gpu: int, cpu: int, caching: bool, watermark: float, offload: int) -> None:
        offload = offload if caching else 0
        if offload:  # a pool that must evict, so the tier fills and is hit
            gpu = min(gpu, 5)
        self.m = KVCacheManager(gpu, cpu, BS, enable_prefix_caching=caching, watermark=watermark,
                                num_offload_blocks=offload)
        self.gpu_mem: dict[int, list[int | None]] = {}
        self.cpu_mem: dict[int, list[int | None]] = {}
        self.tier_mem: dict[int, list[int | None]] = {}
        self.seen: list[list[int]] = []  # prompts asked before (a second ask may hit the tier)
        self.tokens: dict[int, list[int]] = {}  # seq id -> known token ids
        self.groups: dict[int, list[int]] = {}  # request id -> its seq ids
        self.next_id = 0

    # ---- helpers ---------------------------------------------------------------------------

    def _write(self, sid: int, start: int, stop: int) -> None:
        table = self.m.block_table(sid)
        for pos in range(start, stop):
            self.gpu_mem.setdefault(table[pos // BS], [None] * BS)[pos % BS] = self.tokens[sid][pos]

    def _transfers(self) -> None:
        """The step's offloads, then its loads, as a worker applies them."""
        offloads, loads = self.m.take_transfers()
        for g, t in offloads:
            self.tier_mem[t] = list(self.gpu_mem[g])
        for t, g in loads:
            self.gpu_mem[g] = list(self.tier_mem[t])

    def _apply_alloc(self, sid: int, before: int, alloc) -> None:
        self._transfers()
        for src, dst in alloc.copies:
            self.gpu_mem[dst] = list(self.gpu_mem[src])
        self._write(sid, before, self.m.num_slots(sid))

    def _running(self) -> list[int]:
        return [s for s in self.tokens if not self.m.is_swapped(s)]

    def _group_of(self, sid: int) -> int:
        return next(r for r, seqs in self.groups.items() if sid in seqs)

    # ---- rules -----------------------------------------------------------------------------

    @rule(body=tokens_st, system=st.booleans(), salt=st.sampled_from([None, b"s"]),
          use_prefix=st.booleans(), chunk=st.integers(1, 16), admit=st.booleans(),
          again=st.integers(0, 3))
    def new_request(self, body, system, salt, use_prefix, chunk, admit, again) -> None:
        prompt = (SYSTEM if system else []) + body
        if again and self.seen:  # the next turn of an earlier conversation
            prompt = self.seen[-again % len(self.seen)] + body[:2]
        self.seen.append(prompt)
        prefix = self.m.lookup_prefix(prompt, salt) if use_prefix else []
        for i, bid in enumerate(prefix):  # a hit must hold exactly this prompt's tokens
            assert self.gpu_mem[bid] == prompt[i * BS : (i + 1) * BS]
        loaded = self.m.lookup_offloaded(prompt, len(prefix), salt) if use_prefix else []
        for i, tid in enumerate(loaded, len(prefix)):  # and so must a hit in the tier
            assert self.tier_mem[tid] == prompt[i * BS : (i + 1) * BS]
        sid = self.next_id
        hit = (len(prefix) + len(loaded)) * BS
        n = min(chunk, len(prompt) - hit)
        need = self.m.num_blocks_needed(sid, n + len(loaded) * BS, prefix)
        free = self.m.num_free_gpu_blocks
        alloc = self.m.allocate_new(sid, prompt, n, prefix, extra_key=salt, admit=admit,
                                    offloaded_block_ids=loaded)
        limit = self.m.watermark_blocks if admit else 0
        assert (alloc is None) == (need > free - limit)
        if alloc is None:
            assert not self.m.has_seq(sid) and self.m.num_free_gpu_blocks == free
            return
        assert self.m.num_free_gpu_blocks == free - need
        self.next_id += 1
        self.tokens[sid] = list(prompt)
        self.groups[sid] = [sid]
        self._transfers()
        self._write(sid, hit, self.m.num_slots(sid))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), more=st.lists(st.integers(1, 3), max_size=3), n=st.integers(0, 4))
    def append_tokens(self, data, more, n) -> None:
        running = self._running()
        if not running:
            return
        sid = data.draw(st.sampled_from(running))
        self.tokens[sid].extend(more)
        before = self.m.num_slots(sid)
        n = min(n, len(self.tokens[sid]) - before)
        need = self.m.num_blocks_needed(sid, n)
        free = self.m.num_free_gpu_blocks
        alloc = self.m.allocate_slots(sid, self.tokens[sid], n)
        assert (alloc is None) == (need > free)
        if alloc is None:
            assert self.m.num_slots(sid) == before and self.m.num_free_gpu_blocks == free
            return
        assert self.m.num_free_gpu_blocks == free - need
        assert len(alloc.copies) <= 1
        self._apply_alloc(sid, before, alloc)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self.next_id
        self.next_id += 1
        self.m.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent][: self.m.num_slots(parent)])
        self.groups[self._group_of(parent)].append(child)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.m.free(sid)
        del self.tokens[sid]
        rid = self._group_of(sid)
        self.groups[rid].remove(sid)
        if not self.groups[rid]:
            del self.groups[rid]

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def swap_out(self, data) -> None:
        running = [r for r, seqs in self.groups.items() if not self.m.is_swapped(seqs[0])]
        if not running:
            return
        seqs = self.groups[data.draw(st.sampled_from(sorted(running)))]
        distinct = {b for s in seqs for b in self.m.block_table(s)}
        can = self.m.can_swap_out(seqs)
        assert can == (len(distinct) <= self.m.num_free_cpu_blocks)
        if not can:
            return
        pairs = self.m.swap_out(seqs)
        assert sorted(g for g, _ in pairs) == sorted(distinct)
        for g, c in pairs:
            self.cpu_mem[c] = list(self.gpu_mem[g])

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def swap_in(self, data) -> None:
        swapped = [r for r, seqs in self.groups.items() if self.m.is_swapped(seqs[0])]
        if not swapped:
            return
        seqs = self.groups[data.draw(st.sampled_from(sorted(swapped)))]
        if not self.m.can_swap_in(seqs):
            return
        pairs = self.m.swap_in(seqs)
        self._transfers()
        for c, g in pairs:
            self.gpu_mem[g] = list(self.cpu_mem[c])

    # ---- checks ----------------------------------------------------------------------------

    @invariant()
    def invariants_hold_and_tables_read_back_their_tokens(self) -> None:
        if not hasattr(self, "m"):
            return
        self.m.check_invariants()
        for sid, toks in self.tokens.items():
            mem = self.cpu_mem if self.m.is_swapped(sid) else self.gpu_mem
            table = self.m.block_table(sid)
            got = [mem[table[p // BS]][p % BS] for p in range(self.m.num_slots(sid))]
            assert got == toks[: self.m.num_slots(sid)], f"seq {sid} reads wrong KV"

    def teardown(self) -> None:
        if not hasattr(self, "m"):
            return
        for sid in list(self.tokens):
            self.m.free(sid)
        self.m.check_invariants()
        s = self.m.stats()
        assert s.num_free_gpu_blocks == s.num_gpu_blocks
        assert s.num_free_cpu_blocks == s.num_cpu_blocks
        assert all(b.ref_cnt == 0 for b in self.m.gpu_pool.blocks + self.m.cpu_pool.blocks)
        assert not self.m.has_seq(0)


KVCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestKVCacheMachine = KVCacheMachine.TestCase
