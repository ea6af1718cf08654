"""A 128k-token sequence (Qwen3 with YaRN: 4 x 32,768 = 131,072) indexed without int32
overflow, at full size where it is only index math: the KV manager's block table and the
worker's slot mapping (int32 tables, block ids whose slots pass 2^31). The kernels' side is
tests/kernels/test_long_context_kernels.py."""

from __future__ import annotations

import numpy as np
import torch

from kvcache import KVCacheManager
from scheduler.plan import NewSeq, StepPlan
from scheduler.sampling_params import SamplingParams
from workers.seq_table import SeqTable

CONTEXT = 4 * 32768  # Qwen3's documented YaRN context
BLOCK = 16
BLOCKS = CONTEXT // BLOCK


def test_kv_manager_holds_a_128k_sequence_in_chunks() -> None:
    kv = KVCacheManager(num_gpu_blocks=BLOCKS + 64, num_cpu_blocks=0, block_size=BLOCK)
    tokens = np.random.default_rng(0).integers(100, 150000, CONTEXT).tolist()
    for start in range(0, CONTEXT, 8192):  # chunked prefill, 8192 tokens a step
        assert kv.allocate_slots(7, tokens[:start + 8192], 8192) is not None
    table = kv.block_table(7)
    assert len(table) == BLOCKS and len(set(table)) == BLOCKS
    assert kv.num_slots(7) == CONTEXT
    kv.check_invariants()


def test_slot_mapping_of_block_ids_past_int32_slots() -> None:
    """Block ids near 2^28 at block size 16: every slot is past 2^31 (int32 would wrap)."""
    base = 1 << 28
    table = SeqTable(max_num_seqs=2, block_size=BLOCK, max_model_len=CONTEXT, vocab_size=64,
                     seed=0, device=torch.device("cpu"))
    table.num_gpu_blocks = base + BLOCKS
    blocks = [base + BLOCKS - 1 - i for i in range(BLOCKS)]  # reversed: no id follows position
    table.apply(_plan_with(NewSeq(
        3, "r", 0, CONTEXT, [], blocks, SamplingParams(temperature=0))))
    positions = np.array([0, 15, 16, 65535, 65536, CONTEXT - 1], dtype=np.int64)
    rows = table.rows_of(np.array([3] * len(positions), dtype=np.int64))
    want = [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in positions.tolist()]
    got = table.slots(rows, positions)
    assert got.dtype == np.int64 and got.tolist() == want and min(want) > 2 ** 31


def _plan_with(new: NewSeq) -> StepPlan:
    empty = np.zeros(0, dtype=np.int64)
    return StepPlan(step_id=0, seq_ids=empty, query_lens=empty.astype(np.int32),
                    start_pos=empty.astype(np.int32), input_ids=empty,
                    do_sample=np.zeros(0, dtype=bool), new_seqs=[new])
