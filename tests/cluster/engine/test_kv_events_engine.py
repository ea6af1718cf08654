"""The engine's answer to a request router's poll (AsyncLLMEngine.kv_events): the prefix
cache's events and the queued work, read from a real engine between its steps."""

from __future__ import annotations

from cluster.engine.async_llm_engine import AsyncLLMEngine
from cluster.engine.config import EngineConfig
from kvcache import prompt_block_hashes
from kvcache.events import DEVICE, STORED
from scheduler import QueueLoad, SamplingParams

PROMPT = list(range(100, 180))  # 80 tokens: five blocks of 16


def test_kv_events_answer_with_the_stored_blocks_and_the_prompt_tokens_still_owed(
        tiny_model_path: str) -> None:
    engine = AsyncLLMEngine(EngineConfig(model="qwen3-tiny", max_num_seqs=4,
                                         max_num_batched_tokens=32, async_scheduling=False))
    try:
        first, load = engine.kv_events(None, 0)
        assert first.snapshot and load == QueueLoad(0, 0, 0, frozenset())
        engine.engine.add_request("a", PROMPT, SamplingParams(max_tokens=2, ignore_eos=True))
        assert engine.kv_events(first.epoch, first.seq)[1] == QueueLoad(1, 0, 80, frozenset("a"))
        engine.engine.step()  # a chunk of 32: two full blocks enter the prefix cache
        batch, load = engine.kv_events(first.epoch, first.seq)
        assert load == QueueLoad(0, 1, 48, frozenset("a")) and not batch.snapshot
        stored = [h for _, op, medium, hashes in batch.entries if op == STORED
                  and medium == DEVICE for h in hashes]
        assert stored == prompt_block_hashes(PROMPT[:32], 16)
        engine.engine.add_request("b", PROMPT[:32] + [7] * 20, SamplingParams(max_tokens=2))
        # b's first 32 tokens are cached: it owes its last 20
        assert engine.kv_events(batch.epoch, batch.seq)[1] == QueueLoad(1, 1, 48 + 20,
                                                                        frozenset("ab"))
    finally:
        engine.shutdown()
