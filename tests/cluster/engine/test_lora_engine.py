"""Multi-LoRA in the offline engine against the oracle: transformers with each adapter merged
(peft's merge_and_unload), greedy tokens equal in fp32, for one adapter, batches mixing two
adapters and base rows (tp 1 and 2), more adapters than slots, preemption, chunked prefill,
prefix hits, speculative decoding, and the prefix cache kept apart between adapters."""

from __future__ import annotations

import numpy as np
import pytest
from lora_adapters import merged_greedy, merged_greedy_by_name, mixed_prompts, three_adapters

from cluster import LLM, LoRARequest, SamplingParams

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)


_prompts = mixed_prompts


@pytest.fixture(scope="module")
def adapters(tiny_model_path: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return three_adapters(tiny_model_path, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def requests(adapters: dict) -> dict:
    return {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())}


@pytest.fixture(scope="module")
def oracle(tiny_model_path: str, adapters: dict) -> dict:
    """name (None: the base model) -> greedy tokens of each of _prompts()."""
    return merged_greedy_by_name(tiny_model_path, adapters, _prompts(), MAX_NEW)


def _mixed(requests: dict, names: list[str | None]) -> tuple[list[dict], list]:
    """Every prompt under every name in `names`, interleaved so each step mixes them."""
    prompts, loras = [], []
    for i, p in enumerate(_prompts()):
        for name in names:
            prompts.append({"prompt_token_ids": p})
            loras.append((i, name, None if name is None else requests[name]))
    return prompts, loras


def _run_mixed(llm: LLM, requests: dict, oracle: dict, names: list[str | None]) -> list:
    prompts, loras = _mixed(requests, names)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=[r for _, _, r in loras])
    for out, (i, name, _) in zip(outs, loras):
        assert out.outputs[0].token_ids == oracle[name][i], (name, i)
    return outs


def _assert_all_blocks_free(llm: LLM) -> None:
    kv = llm.engine.scheduler.kv
    assert kv.num_free_gpu_blocks == kv.num_gpu_blocks


def test_adapters_change_the_outputs(oracle: dict) -> None:
    """(Else the tests below would pass without any LoRA.)"""
    for name in "abc":
        assert oracle[name] != oracle[None]


def test_one_adapter_matches_merged_transformers_and_chat_takes_it(
        requests: dict, oracle: dict) -> None:
    with LLM("qwen3-tiny", enable_lora=True, max_lora_rank=8) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], GREEDY,
                            use_tqdm=False, lora_request=requests["a"])
        assert [o.outputs[0].token_ids for o in outs] == oracle["a"]
        conv = [{"role": "user", "content": "Hello"}]
        chat = llm.chat(conv, GREEDY, use_tqdm=False, lora_request=requests["a"])
        text = llm.get_tokenizer().apply_chat_template(conv, tokenize=False,
                                                       add_generation_prompt=True)
        again = llm.generate(text, GREEDY, use_tqdm=False, lora_request=requests["a"])
        base = llm.generate(text, GREEDY, use_tqdm=False)
        assert chat[0].outputs[0].token_ids == again[0].outputs[0].token_ids
        assert chat[0].outputs[0].token_ids != base[0].outputs[0].token_ids
        _assert_all_blocks_free(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_batch_mixing_two_adapters_and_base_rows(requests: dict, oracle: dict,
                                                   async_scheduling: bool) -> None:
    with LLM("qwen3-tiny", enable_lora=True, max_loras=2, max_lora_rank=8,
             async_scheduling=async_scheduling) as llm:
        _run_mixed(llm, requests, oracle, ["a", None, "b"])
        _assert_all_blocks_free(llm)


def test_decode_steps_through_the_graph_path_read_each_steps_slots(
        requests: dict, oracle: dict) -> None:
    """EagerGraph replays the captured decode function on CPU: the slots reach it through the
    persistent buffer, padded rows as the base model."""
    from workers.cuda_graph import EagerGraph

    with LLM("qwen3-tiny", device="cpu", executor="inprocess", enable_lora=True, max_loras=2,
             max_lora_rank=8, max_num_seqs=16) as llm:
        runner = llm.engine.executor.worker.model_runner
        llm.engine.executor.worker.capture_graphs(EagerGraph)
        kinds = []
        prepare = runner.prepare

        def logged(plan):
            batch = prepare(plan)
            kinds.append((batch.graph_size, plan.num_seqs))
            return batch

        runner.prepare = logged
        _run_mixed(llm, requests, oracle, ["a", None, "b"])
        assert any(size > seqs for size, seqs in kinds)  # padded graph steps ran
        _assert_all_blocks_free(llm)


@pytest.mark.slow
def test_a_batch_mixing_two_adapters_and_base_rows_tp2_on_ray(
        ray_cluster: None, requests: dict, oracle: dict) -> None:
    """Column-parallel B and row-parallel A are sharded per rank; the all-reduce sums them."""
    with LLM("qwen3-tiny", tensor_parallel_size=2, worker_num_cpus=0.5, enable_lora=True,
             max_loras=2, max_lora_rank=8, max_num_seqs=8, max_num_batched_tokens=64) as llm:
        _run_mixed(llm, requests, oracle, ["a", None, "b", "c"])
        _assert_all_blocks_free(llm)


def _record_plans(llm: LLM) -> list:
    plans = []
    submit = llm.engine.executor.submit

    def recording(plan):
        plans.append(plan)
        return submit(plan)

    llm.engine.executor.submit = recording
    return plans


def test_more_adapters_than_slots_wait_and_every_step_fits_the_slots(
        requests: dict, oracle: dict) -> None:
    with LLM("qwen3-tiny", enable_lora=True, max_loras=2, max_lora_rank=8,
             max_cpu_loras=2) as llm:
        plans = _record_plans(llm)
        _run_mixed(llm, requests, oracle, ["a", "b", None, "c"])
        slot_of: dict[int, int] = {}
        for plan in plans:
            slot_of.update({n.seq_id: n.lora_slot for n in plan.new_seqs})
            used = {slot_of[int(s)] for s in plan.seq_ids} - {-1}
            assert used <= {0, 1}
        loads = [(load.slot, load.lora_id) for plan in plans for load in plan.lora_loads]
        assert len({lid for _, lid in loads}) == 3 and len(loads) >= 3  # c waited for a slot
        assert llm.engine.loras.max_cpu_loras == 2 and len(llm.engine.loras.loaded) <= 2
        llm.engine.scheduler.lora.check()
        assert not any(llm.engine.scheduler.lora.users.values())
        _assert_all_blocks_free(llm)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_adapters_under_preemption_and_chunked_prefill(requests: dict, oracle: dict,
                                                       mode: str) -> None:
    with LLM("qwen3-tiny", enable_lora=True, max_loras=2, max_lora_rank=8,
             num_gpu_blocks_override=9, max_num_batched_tokens=24, max_num_seqs=6,
             preemption_mode=mode, swap_space=0.05 if mode == "swap" else 0) as llm:
        _run_mixed(llm, requests, oracle, ["a", None, "b"])
        stats = llm.engine.scheduler.stats()
        assert (stats.preemptions_swap if mode == "swap" else stats.preemptions_recompute) > 0
        _assert_all_blocks_free(llm)


def test_prefix_hits_stay_within_one_adapter(requests: dict, oracle: dict) -> None:
    prompt = _prompts()[1]  # 51 tokens: 3 full blocks
    with LLM("qwen3-tiny", enable_lora=True, max_loras=2, max_lora_rank=8) as llm:
        def run(name: str | None):
            out = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False,
                               lora_request=None if name is None else requests[name])[0]
            assert out.outputs[0].token_ids == oracle[name][1]
            return out.num_cached_tokens

        assert run("a") == 0
        assert run("b") == 0  # another adapter: its KV differs, no block shared
        assert run(None) == 0  # nor the base model's
        assert run("a") == 48  # the same adapter hits its own blocks
        assert run(None) == 48
        _assert_all_blocks_free(llm)


def test_ngram_speculative_decoding_with_adapters_is_exact(requests: dict, oracle: dict) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3, "disable_by_batch_size": 16}
    with LLM("qwen3-tiny", enable_lora=True, max_loras=2, max_lora_rank=8,
             speculative_config=spec) as llm:
        _run_mixed(llm, requests, oracle, ["a", None, "b"])
        m = llm.engine.metrics()
        assert m["spec_decode_num_drafts"] > 0 and m["spec_decode_num_accepted_tokens"] > 0
        _assert_all_blocks_free(llm)


def test_draft_model_speculative_decoding_with_adapters_is_exact(
        requests: dict, oracle: dict) -> None:
    """The draft (no adapter) proposes; the target verifies under each row's adapter."""
    spec = {"model": "qwen3-tiny-draft", "num_speculative_tokens": 3,
            "disable_by_batch_size": 16}
    with LLM("qwen3-tiny", enable_lora=True, max_loras=2, max_lora_rank=8,
             speculative_config=spec) as llm:
        _run_mixed(llm, requests, oracle, ["a", None, "b"])
        assert llm.engine.metrics()["spec_decode_num_drafts"] > 0
        _assert_all_blocks_free(llm)


def test_lora_refusals_name_the_fix(requests: dict, adapters: dict, tmp_path) -> None:
    with LLM("qwen3-tiny") as llm:
        with pytest.raises(ValueError, match="LoRA is off; start the engine with enable_lora"):
            llm.generate("Hi", GREEDY, use_tqdm=False, lora_request=requests["a"])
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        LLM("qwen3-tiny", enable_lora=True, max_loras=2, max_cpu_loras=1)
    with LLM("qwen3-tiny", enable_lora=True, max_lora_rank=4) as llm:
        with pytest.raises(ValueError, match="r=8 exceeds max_lora_rank=4"):
            llm.generate(["Hi", "Ho"], GREEDY, use_tqdm=False,
                         lora_request=[requests["b"], requests["a"]])
        assert not llm.engine.has_unfinished()  # nothing was queued
        with pytest.raises(ValueError, match="got 1 lora_requests for 2 prompts"):
            llm.generate(["Hi", "Ho"], GREEDY, use_tqdm=False, lora_request=[requests["b"]])
        with pytest.raises(ValueError, match="no adapter_config.json"):
            llm.generate("Hi", GREEDY, use_tqdm=False,
                         lora_request=LoRARequest("missing", 9, str(tmp_path)))
        out = llm.generate({"prompt_token_ids": _prompts()[0]}, GREEDY, use_tqdm=False,
                           lora_request=requests["b"])  # r=4 fits
        assert out[0].outputs[0].token_ids == merged_greedy_b(adapters, requests)


def merged_greedy_b(adapters: dict, requests: dict) -> list[int]:
    from workers.tiny_model import resolve_model

    return merged_greedy(resolve_model("qwen3-tiny"), adapters["b"], _prompts()[:1], MAX_NEW)[0]


def test_lora_slots_are_counted_before_the_kv_cache_is_sized(
        tiny_model_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.cache_sizing import CPU_KV_CACHE_BYTES
    from workers.config import WorkerConfig
    from workers.worker import Worker

    def blocks(max_loras: int) -> tuple[int, int, int]:
        worker = Worker(WorkerConfig(model=tiny_model_path, max_num_seqs=256, max_model_len=4096,
                                     max_loras=max_loras, max_lora_rank=16 if max_loras else 0))
        worker.load_model()
        lora_bytes = 0 if worker.lora is None else worker.lora.nbytes
        return worker.determine_num_blocks()[0], worker.kv_block_bytes(), lora_bytes

    plain, block_bytes, _ = blocks(0)
    with_lora, _, lora_bytes = blocks(4)
    assert plain == CPU_KV_CACHE_BYTES // block_bytes
    assert lora_bytes > 0 and with_lora == (CPU_KV_CACHE_BYTES - lora_bytes) // block_bytes
    assert np.isclose(plain - with_lora, lora_bytes / block_bytes, atol=1)
    # slots that leave less than one max_model_len sequence of KV are refused at start
    monkeypatch.setattr("workers.cache_sizing.CPU_KV_CACHE_BYTES", lora_bytes + 100 * block_bytes)
    with pytest.raises(ValueError, match=r"leaving 100 KV blocks \(one max_model_len=4096 "
                                         r"sequence needs 256\); lower max_loras"):
        blocks(4)
