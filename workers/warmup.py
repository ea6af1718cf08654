"""Start-up warm-up: plans that reach every kernel specialization the serving path can hit.

Triton compiles a kernel once per set of constexpr choices and per specialization of its
integer and pointer arguments (== 1, divisible by 16); the attention kernels pick tiles and
split-K segments from the batch's query and sequence lengths; the caching allocator grows to a
step's peak the first time that step runs. Any of these met first by a user's request costs
that request milliseconds to seconds. `warmup_plans` walks the shape classes once at start-up
(after the KV cache and the decode graphs exist): single prefill chunks of every length class
up to max_num_batched_tokens, with and without a cached prefix; batches of 1-5 sequences (the
staged arrays' alignment depends on the counts); a mixed decode + prefill batch; decodes at
short, medium and full contexts (eager, when there are no graphs); a decode step of every
shape the caller names (`decode_shapes`: the attention kernel's split-K factors, from its own
choice function), run eagerly even where graphs exist (rows that do not sample never replay a
graph), since graphs capture only the factor of the longest context; and every sampling option
(plain temperature rows alone too).
Each plan's sequences are dropped by the next plan: the worker ends the warm-up holding none.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from scheduler.plan import NewSeq, StepPlan
from scheduler.sampling_params import SamplingParams

# Query lengths around the powers of two the kernels' tiles are cut at.
_QUERY_LENS = (1, 2, 3, 4, 5, 7, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 127, 128, 129, 255,
               256, 257, 511, 512, 513, 1000, 1024, 2048, 4096, 8192, 16384)
_PREFIXED_LENS = (1, 16, 17, 100, 1000, 4096)
_PREFIX = 37
_ROOM = 8  # tokens each warm-up sequence may compute after its first plan
_SAMPLING = (
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=0.8, seed=1),
    SamplingParams(temperature=1.0, top_k=20),
    SamplingParams(temperature=1.0, top_p=0.9),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=1.0, presence_penalty=0.5, repetition_penalty=1.2),
    SamplingParams(temperature=0.0, logprobs=5),
)
# Plain temperature rows, seeded and not: a batch of only these takes the sampler's simple path
# (temperature inside the draw kernel), which the mixed batches above never reach.
_PLAIN = (SamplingParams(temperature=0.7), SamplingParams(temperature=0.7, seed=2))


class _Plans:
    def __init__(self, block_size: int, num_blocks: int) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.step = -1_000_000
        self.seq = 0
        self.live: list[int] = []

    def fits(self, lens: list[int], room: int = _ROOM) -> bool:
        return sum(self._blocks(n, room) for n in lens) <= self.num_blocks

    def _blocks(self, tokens: int, room: int = _ROOM) -> int:
        return -(-(tokens + room) // self.block_size)

    def batch(self, starts: list[int], qlens: list[int],
              params: tuple[SamplingParams, ...] = _SAMPLING[:1], sample: bool = True,
              room: int = _ROOM) -> StepPlan:
        """New sequences with `starts[i]` tokens cached and `qlens[i]` to compute, and blocks
        for `room` more; with `sample` False no row samples."""
        news, block = [], 0
        seq_ids = list(range(self.seq, self.seq + len(qlens)))
        self.seq += len(qlens)
        for i, (s, (start, q)) in enumerate(zip(seq_ids, zip(starts, qlens))):
            n = self._blocks(start + q, room)
            news.append(NewSeq(s, "warm-up", 0, start + q, [0] * start,
                               list(range(block, block + n)), params[i % len(params)]))
            block += n
        return self._plan(seq_ids, qlens, starts, news, sample=sample)

    def more(self, seq_ids: list[int], starts: list[int], qlens: list[int]) -> StepPlan:
        """A further step of live sequences (at most _ROOM more tokens each in all)."""
        return self._plan(seq_ids, qlens, starts, [], drop=False)

    def _plan(self, seq_ids: list[int], qlens: list[int], starts: list[int],
              news: list[NewSeq], drop: bool = True, sample: bool = True) -> StepPlan:
        self.step += 1
        dropped = self.live if drop else []
        if drop:
            self.live = list(seq_ids)
        total = int(sum(qlens))
        return StepPlan(self.step, np.array(seq_ids, np.int64), np.array(qlens, np.int32),
                        np.array(starts, np.int32), np.full(total, 100, np.int64),
                        np.full(len(seq_ids), sample), new_seqs=news,
                        dropped_seq_ids=dropped)

    def drop_all(self) -> StepPlan:
        return self._plan([], [], [], [])


def warmup_plans(block_size: int, num_gpu_blocks: int, max_model_len: int,
                 max_num_batched_tokens: int, max_num_seqs: int, eager_decode: bool,
                 decode_shapes: Sequence[tuple[int, int]] = ()) -> Iterator[StepPlan]:
    """The warm-up's plans, in order (see the module docstring); `decode_shapes`: (batch size,
    longest sequence) of decode steps to run eagerly."""
    p = _Plans(block_size, num_gpu_blocks)
    limit = min(max_num_batched_tokens, max_model_len - 1 - _ROOM)
    # The largest step (as the memory profile ran it): the allocator keeps that peak cached.
    num_seqs = min(max_num_seqs, limit)
    lens = [limit // num_seqs + (i < limit % num_seqs) for i in range(num_seqs)]
    if p.fits(lens):
        yield p.batch([0] * num_seqs, lens, _SAMPLING)
    for q in _QUERY_LENS:
        if q <= limit and p.fits([q]):
            yield p.batch([0], [q])
    for q in _PREFIXED_LENS:
        if _PREFIX + q < max_model_len and q <= limit and p.fits([_PREFIX + q]):
            yield p.batch([_PREFIX], [q])
    for b in range(1, 6):
        if b <= max_num_seqs and 3 * b <= limit and p.fits([3] * b):
            yield p.batch([0] * b, [3] * b)
    # the draw kernel spreads a row over more programs up to 8 rows: both sides of that
    for b in sorted({1, min(9, max_num_seqs)}):
        if 3 * b <= limit and p.fits([3] * b):
            yield p.batch([0] * b, [3] * b, _PLAIN)
    n = min(len(_SAMPLING), max_num_seqs)
    if 20 * n <= limit and p.fits([40] * n):
        plan = p.batch([0] * n, [20] * n, _SAMPLING)
        yield plan
        seqs = plan.seq_ids.tolist()
        yield p.more(seqs, [20] * n, [1] * n)  # every sampling option in a decode step
        # decodes beside a prefill chunk
        yield p.more(seqs, [21] * n, [1] * (n - 1) + [5])
    if eager_decode:
        for ctx in sorted({16, 1024, max_model_len // 2, max_model_len - 1 - _ROOM}):
            b = max_num_seqs
            while b > 1 and not p.fits([ctx] * b):
                b //= 2
            q = min(ctx, limit // b)
            if q >= 1 and q + _ROOM < max_model_len and p.fits([q] * b):
                plan = p.batch([0] * b, [q] * b)
                yield plan
                yield p.more(plan.seq_ids.tolist(), [q] * b, [1] * b)
    for b, seq_len in decode_shapes:
        # one sequence of seq_len tokens and b - 1 of one, each computing its last token
        lens = [seq_len] + [1] * (b - 1)
        if b <= min(max_num_seqs, limit) and seq_len <= max_model_len and p.fits(lens, 0):
            yield p.batch([n - 1 for n in lens], [1] * b, sample=False, room=0)
    yield p.drop_all()
