"""The offline LLM against the oracle (Hugging Face transformers), in-process and on Ray."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cluster import LLM, SamplingParams
from cluster.engine.async_llm_engine import AsyncLLMEngine
from cluster.engine.config import EngineConfig
from cluster.engine.errors import EngineDeadError

MAX_NEW = 12


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(100, 150000) for _ in range(56)]  # 3.5 blocks of 16
    prompts = [shared + [rng.randrange(100, 150000) for _ in range(k)] for k in (1, 9, 30)]
    prompts += [[rng.randrange(100, 150000) for _ in range(k)] for k in (3, 17, 70)]
    return prompts


def _short_prompts_long_outputs() -> list[list[int]]:
    """Six 2-block prompts that grow to 4 blocks each: 8 KV blocks cannot hold them all."""
    rng = random.Random(11)
    return [[rng.randrange(100, 150000) for _ in range(20 + i)] for i in range(6)]


LONG_NEW = 40


def _hf_greedy(path: str, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False)
            outs.append(ids[0, len(p):].tolist())
    return outs


@pytest.fixture(scope="module")
def oracle(tiny_model_path: str) -> list[list[int]]:
    return _hf_greedy(tiny_model_path, _prompts(), MAX_NEW)


@pytest.fixture(scope="module")
def long_oracle(tiny_model_path: str) -> list[list[int]]:
    return _hf_greedy(tiny_model_path, _short_prompts_long_outputs(), LONG_NEW)


def _token_ids(llm: LLM, prompts: list[list[int]] | None = None,
               max_new: int = MAX_NEW) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_new)
    outs = llm.generate([{"prompt_token_ids": p} for p in (prompts or _prompts())], params,
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _assert_all_blocks_free(llm: LLM) -> None:
    kv = llm.engine.scheduler.kv
    kv.check_invariants()
    stats = kv.stats()
    assert stats.num_free_gpu_blocks == stats.num_gpu_blocks
    assert stats.num_free_cpu_blocks == stats.num_cpu_blocks


def _force_decode_lane(llm: LLM) -> None:
    """Let the scheduler's decode lane run at these tests' few requests (by default it needs
    scheduler.decode_lane.LANE_MIN_RUNNING of them)."""
    llm.engine.scheduler.lane.min_running = 1


@pytest.mark.parametrize("lane", [False, True])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_greedy_matches_transformers_in_process(oracle: list[list[int]],
                                                async_scheduling: bool, lane: bool) -> None:
    with LLM("qwen3-tiny", max_num_seqs=8, max_num_batched_tokens=64,
             async_scheduling=async_scheduling) as llm:
        if lane:
            _force_decode_lane(llm)
        assert _token_ids(llm) == oracle
        assert (llm.engine.scheduler.lane.steps > 0) == lane
        _assert_all_blocks_free(llm)
        # The shared 56-token prefix is three full blocks, computed once and hit twice.
        assert llm.engine.scheduler.kv.stats().prefix_hits >= 2 * 48


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_tiny_cache_preempts_and_still_matches(long_oracle: list[list[int]], mode: str,
                                               async_scheduling: bool) -> None:
    with LLM("qwen3-tiny", num_gpu_blocks_override=8, swap_space=0.01,
             preemption_mode=mode, async_scheduling=async_scheduling) as llm:
        assert _token_ids(llm, _short_prompts_long_outputs(), LONG_NEW) == long_oracle
        stats = llm.engine.scheduler.stats()
        key = "preemptions_swap" if mode == "swap" else "preemptions_recompute"
        assert getattr(stats, key) > 0
        _assert_all_blocks_free(llm)


def test_async_scheduling_gives_the_synchronous_outputs_for_every_sampling_option() -> None:
    """Seeded sampling, penalties, min_tokens, stop strings, logprobs and n = 2 see the same
    histories and positions whether a step is scheduled ahead or not, and whether the
    decode lane schedules the plain decodes in bulk or not."""
    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 150000) for _ in range(k)]}
               for k in (5, 19, 33, 40, 8, 26)]
    params = [
        SamplingParams(temperature=0.9, top_p=0.8, top_k=50, seed=11, max_tokens=20),
        SamplingParams(temperature=1.0, seed=5, presence_penalty=1.5, frequency_penalty=0.5,
                       repetition_penalty=1.3, max_tokens=24),
        SamplingParams(temperature=0.7, seed=9, min_tokens=6, max_tokens=16, logprobs=3),
        SamplingParams(temperature=0.8, seed=2, n=2, max_tokens=12),
        SamplingParams(temperature=0.0, max_tokens=30, stop=["a", "e", " "]),
        SamplingParams(temperature=1.2, min_p=0.05, seed=4, max_tokens=18, stop_token_ids=[1000],
                       logit_bias={1000: 3.0, 220: 2.0, 15: -100.0}),
    ]
    runs = []
    for async_scheduling, lane in ((False, False), (True, False), (True, True)):
        with LLM("qwen3-tiny", max_num_seqs=8, max_num_batched_tokens=48,
                 num_gpu_blocks_override=14, async_scheduling=async_scheduling) as llm:
            if lane:
                _force_decode_lane(llm)
            outs = llm.generate(prompts, params, use_tqdm=False)
            assert (llm.engine.scheduler.lane.steps > 0) == lane
            runs.append([[(c.token_ids, c.text, c.finish_reason, c.logprobs)
                          for c in o.outputs] for o in outs])
            stats = llm.engine.scheduler.stats()
            assert stats.preemptions_swap + stats.preemptions_recompute > 0  # 14 blocks
            _assert_all_blocks_free(llm)
    for run in runs[1:]:
        for req, base in zip(run, runs[0]):
            for (tokens, text, reason, lps), (btokens, btext, breason, blps) in zip(req, base):
                assert (tokens, text, reason) == (btokens, btext, breason)
                assert (lps is None) == (blps is None)
                # The same tokens and top ids; values equal up to float noise (a step's batch
                # differs between the modes, and fp32 GEMMs round by their shapes).
                for lp, blp in zip(lps or [], blps or []):
                    assert list(lp) == list(blp)
                    assert max(abs(lp[k] - blp[k]) for k in lp) < 1e-4
    # Not a vacuous comparison: the options did bite.
    assert any(c[2] == "stop" for c in runs[0][4])
    assert len(runs[0][3]) == 2 and runs[0][3][0][0] != runs[0][3][1][0]
    assert runs[0][2][0][3] is not None and len(runs[0][2][0][3]) == len(runs[0][2][0][0])


def test_seeded_request_draws_the_same_tokens_alone_in_a_crowd_async_and_preempted() -> None:
    """A seeded sample's k-th token depends only on (seed, sample index, k) and its own logits:
    not on the 64 requests around it, on async scheduling, or on preemption in between."""
    rng = random.Random(5)
    target = {"prompt_token_ids": [rng.randrange(100, 150000) for _ in range(21)]}
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24)
    crowd = [{"prompt_token_ids": [rng.randrange(100, 150000) for _ in range(rng.randrange(3, 40))]}
             for _ in range(64)]
    crowd_params = [SamplingParams(temperature=rng.choice([0.0, 0.7, 1.3]), max_tokens=8,
                                   seed=rng.choice([None, rng.randrange(1 << 30)]))
                    for _ in crowd]
    runs = {}
    for name, kwargs, batch in (
            ("alone", {"async_scheduling": False}, False),
            ("alone-async", {"async_scheduling": True}, False),
            ("crowd", {"async_scheduling": False}, True),
            ("crowd-async", {"async_scheduling": True}, True),
            ("crowd-recompute", {"async_scheduling": True, "num_gpu_blocks_override": 24,
                                 "preemption_mode": "recompute"}, True),
            ("crowd-swap", {"async_scheduling": False, "num_gpu_blocks_override": 24,
                            "preemption_mode": "swap"}, True)):
        prompts = [*crowd[:32], target, *crowd[32:]] if batch else [target]
        all_params = [*crowd_params[:32], params, *crowd_params[32:]] if batch else [params]
        with LLM("qwen3-tiny", max_num_seqs=64, max_num_batched_tokens=256, **kwargs) as llm:
            outs = llm.generate(prompts, all_params, use_tqdm=False)
            runs[name] = outs[32 if batch else 0].outputs[0].token_ids
            if "num_gpu_blocks_override" in kwargs:
                stats = llm.engine.scheduler.stats()
                assert stats.preemptions_swap + stats.preemptions_recompute > 0
    assert len(runs["alone"]) == 24
    for name, tokens in runs.items():
        assert tokens == runs["alone"], name
    # The seed really decides: another seed draws other tokens.
    with LLM("qwen3-tiny", max_num_seqs=4) as llm:
        other = llm.generate([target], SamplingParams(temperature=1.0, top_p=0.95, seed=4321,
                                                      max_tokens=24), use_tqdm=False)
    assert other[0].outputs[0].token_ids != runs["alone"]


@pytest.mark.gpu
@pytest.mark.parametrize("async_scheduling", [None, False])
def test_cuda_engine_greedy_matches_transformers(oracle: list[list[int]],
                                                 async_scheduling: bool | None) -> None:
    """On CUDA async scheduling is the default (None: auto): pending tokens, CUDA graphs.
    (A cache of its own size, 16 MiB: gpu_memory_utilization's default took 69 GiB of the
    GPU the report's six test workers share.)"""
    with LLM("qwen3-tiny", device="cuda", dtype="float32", max_num_seqs=8,
             max_num_batched_tokens=64, async_scheduling=async_scheduling,
             num_gpu_blocks_override=512, swap_space=0.0625) as llm:
        assert llm.engine.async_scheduling is (async_scheduling is None)
        assert _token_ids(llm) == oracle
        _assert_all_blocks_free(llm)


def test_generate_returns_text_in_input_order_and_chat_works() -> None:
    with LLM("qwen3-tiny") as llm:
        assert llm.engine.async_scheduling is False  # auto: off on CPU
        tok = llm.get_tokenizer()
        outs = llm.generate(["Hello", "The capital of France is"],
                            SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
        assert [o.prompt for o in outs] == ["Hello", "The capital of France is"]
        assert outs[0].prompt_token_ids == tok.encode("Hello")
        for o in outs:
            assert o.finished and o.outputs[0].finish_reason == "length"
            assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids)
        chat = llm.chat([{"role": "user", "content": "hi"}],
                        SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        assert chat[0].prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        assert len(chat[0].outputs[0].token_ids) == 3


def test_logit_bias_forces_and_bans_tokens() -> None:
    """+100 on a token makes greedy decoding pick it every step; -100 on the unbiased greedy
    choice makes it never come out; a request without a bias in the same batch is untouched."""
    prompts = [{"prompt_token_ids": p} for p in _prompts()[:3]]
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    with LLM("qwen3-tiny", max_num_seqs=8) as llm:
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        banned = plain[1][0]
        params = [SamplingParams(temperature=0.0, max_tokens=8, logit_bias={4242: 100}),
                  SamplingParams(temperature=0.0, max_tokens=8, logit_bias={banned: -100}),
                  greedy]
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        # sampled too: a +100 token holds all the probability mass
        hot = llm.generate(prompts[:1], SamplingParams(temperature=1.0, seed=1, max_tokens=8,
                                                       logit_bias={777: 100}), use_tqdm=False)
        _assert_all_blocks_free(llm)
    assert outs[0] == [4242] * 8
    assert banned not in outs[1] and outs[1] != plain[1]
    assert outs[2] == plain[2]
    assert hot[0].outputs[0].token_ids == [777] * 8


def test_bad_prompt_is_a_value_error_and_nothing_runs() -> None:
    with LLM("qwen3-tiny", max_model_len=64) as llm:
        with pytest.raises(ValueError, match=r"prompt \(60 tokens\) \+ max_tokens \(10\) = 70 "
                                             r"exceeds max_model_len \(64\)"):
            llm.generate([{"prompt_token_ids": [5] * 3}, {"prompt_token_ids": [5] * 60}],
                         SamplingParams(max_tokens=10), use_tqdm=False)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.generate({"prompt_token_ids": [10**9]}, use_tqdm=False)
        with pytest.raises(ValueError, match=r"logit_bias names token id 200000, outside the "
                                             r"vocabulary \[0, 151936\)"):
            llm.generate({"prompt_token_ids": [5]}, SamplingParams(logit_bias={200000: 1}),
                         use_tqdm=False)
        assert not llm.engine.has_unfinished()


def test_engine_config_rejects_unknown_and_bad_args() -> None:
    with pytest.raises(ValueError, match=r"unknown engine argument\(s\) \['tp'\]"):
        EngineConfig.from_dict({"tp": 2})
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        EngineConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="executor 'inprocess' runs one worker"):
        EngineConfig(tensor_parallel_size=2, executor="inprocess")
    with pytest.raises(ValueError, match=r"async_scheduling must be true, false or null \(auto\)"):
        EngineConfig(async_scheduling="yes")


@pytest.mark.parametrize(("async_scheduling", "lane"), [(True, False), (False, False),
                                                        (True, True)])
def test_async_engine_streams_match_the_oracle_and_an_abort_frees_its_blocks(
        oracle: list[list[int]], async_scheduling: bool, lane: bool) -> None:
    """The Serve replica's engine: concurrent streams, one of them abandoned mid-way."""
    engine = AsyncLLMEngine(EngineConfig(model="qwen3-tiny", max_num_seqs=8,
                                         max_num_batched_tokens=64,
                                         async_scheduling=async_scheduling))
    if lane:
        engine.engine.scheduler.lane.min_running = 1  # (see _force_decode_lane)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)

    async def collect(prompt: list[int], rid: str) -> list[int]:
        return [t async for out in engine.generate(prompt, params, rid)
                for t in out.outputs[0].token_ids]

    async def abandon() -> int:
        stream = engine.generate(list(range(200, 240)),
                                 SamplingParams(max_tokens=500, ignore_eos=True), "dropped")
        got = [await stream.__anext__() for _ in range(3)]
        await stream.aclose()  # what a client disconnect does
        return len(got)

    async def run() -> list:
        return await asyncio.gather(abandon(), *(collect(p, f"r{i}")
                                                 for i, p in enumerate(_prompts())))

    try:
        got = asyncio.run(asyncio.wait_for(run(), timeout=120))
        assert got[0] == 3 and got[1:] == oracle
        sched = engine.engine.scheduler
        assert (sched.lane.steps > 0) == lane
        assert not sched.has_unfinished() and not engine.engine.has_unfinished()
        kv = sched.kv.stats()
        assert kv.num_free_gpu_blocks == kv.num_gpu_blocks
    finally:
        engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_greedy_matches_transformers_tp2_on_ray(ray_cluster: None, oracle: list[list[int]],
                                                async_scheduling: bool) -> None:
    """Async scheduling on tp = 2: rank 0 broadcasts the tokens the next plan leaves pending."""
    with LLM("qwen3-tiny", tensor_parallel_size=2, worker_num_cpus=0.5,
             max_num_seqs=8, max_num_batched_tokens=64,
             async_scheduling=async_scheduling) as llm:
        assert llm.engine.executor.num_gpu_blocks > 0
        assert _token_ids(llm) == oracle
        _assert_all_blocks_free(llm)


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_killed_worker_is_replaced_and_its_streams_go_on(ray_cluster: None,
                                                           async_scheduling: bool) -> None:
    """SIGKILL rank 1 mid-stream: the engine rebuilds the group and the stream continues
    with the tokens it would have had (greedy), no error; not ready while rebuilding."""
    import os
    import signal

    import ray

    config = EngineConfig(model="qwen3-tiny", tensor_parallel_size=2, worker_num_cpus=0.5,
                          async_scheduling=async_scheduling)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    prompt = list(range(100, 140))
    with LLM("qwen3-tiny", async_scheduling=async_scheduling) as llm:  # the reference
        expected = llm.generate([{"prompt_token_ids": prompt}], params,
                                use_tqdm=False)[0].outputs[0].token_ids
    engine = AsyncLLMEngine(config)

    async def run() -> list[int]:
        tokens: list[int] = []
        stream = engine.generate(prompt, params, "victim")
        tokens += (await stream.__anext__()).outputs[0].token_ids
        pid = ray.get(engine.engine.executor.workers[1].pid.remote())
        os.kill(pid, signal.SIGKILL)
        saw_not_ready = False
        async for out in stream:
            tokens += out.outputs[0].token_ids
            try:
                engine.check_ready()
            except Exception:  # noqa: BLE001 — EngineRecoveringError while rebuilding
                saw_not_ready = True
        assert engine.engine.recoveries == 1
        return tokens, saw_not_ready

    try:
        tokens, _ = asyncio.run(asyncio.wait_for(run(), timeout=120))
        assert tokens == expected
        engine.check_ready()  # ready again
    finally:
        engine.shutdown()


def test_a_rebuild_that_keeps_failing_ends_the_engine(ray_cluster: None) -> None:
    """Rebuilding after a death is tried MAX_REBUILD_ATTEMPTS times; then the engine is
    dead (Serve replaces the replica), and streams end with EngineDeadError."""
    import ray

    from cluster.engine.engine_setup import MAX_REBUILD_ATTEMPTS
    from cluster.engine.ray_executor import RayExecutor

    engine = AsyncLLMEngine(EngineConfig(model="qwen3-tiny", tensor_parallel_size=2,
                                         worker_num_cpus=0.5))
    executor = engine.engine.executor
    attempts = []

    def failing_rebuild() -> None:
        attempts.append(1)
        RayExecutor._stop(executor)
        raise RuntimeError("no GPU left for the new rank")

    executor.rebuild = failing_rebuild

    async def run() -> None:
        stream = engine.generate(list(range(100, 140)),
                                 SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True),
                                 "victim")
        await stream.__anext__()
        ray.kill(executor.workers[1])
        with pytest.raises(EngineDeadError, match="rebuilding the workers failed"):
            async for _ in stream:
                pass

    try:
        asyncio.run(asyncio.wait_for(run(), timeout=60))
        assert len(attempts) == MAX_REBUILD_ATTEMPTS
        with pytest.raises(EngineDeadError):
            engine.check_health()
    finally:
        engine.shutdown()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_idle_ray_workers_park_and_burn_no_cpu(ray_cluster: None) -> None:
    """A compiled graph's ranks spin on their input channel between plans; an idle engine
    parks them on a socket (cluster/engine/wakeup.py): 5 s idle cost < 0.25 s of CPU per
    worker (they spin at most of a core each without it), and the next request is served as
    before."""
    import signal

    import ray

    engine = AsyncLLMEngine(EngineConfig(model="qwen3-tiny", tensor_parallel_size=2,
                                         worker_num_cpus=0.5))

    async def run() -> tuple[list[float], list[int]]:
        params = SamplingParams(temperature=0, max_tokens=6)
        first = [o async for o in engine.generate([5, 6, 7, 8], params, "a")]
        pids = ray.get([w.pid.remote() for w in engine.engine.executor.workers])
        for pid in pids:  # CPU workers start with OpenMP threads that sleep when idle
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert b"OMP_WAIT_POLICY=PASSIVE" in environ
        await asyncio.sleep(0.5)  # the loop notices it is idle and parks the workers
        before = [_cpu_seconds(p) for p in pids]
        await asyncio.sleep(5)
        used = [_cpu_seconds(p) - b for p, b in zip(pids, before)]
        again = [o async for o in engine.generate([5, 6, 7, 8], params, "b")]
        tokens = [o.outputs[0].token_ids for o in first], [o.outputs[0].token_ids for o in again]
        assert sum(tokens[0], []) == sum(tokens[1], [])  # the same greedy answer after idle
        # A rank killed while the workers are parked: the next probe finds it, the engine
        # rebuilds (waking the dead rank must not hurt the engine), and serves again.
        await asyncio.sleep(0.5)
        os.kill(pids[1], signal.SIGKILL)
        await asyncio.sleep(3)
        after = [o async for o in engine.generate([5, 6, 7, 8], params, "c")]
        assert sum([o.outputs[0].token_ids for o in after], []) == sum(tokens[0], [])
        assert engine.engine.recoveries == 1
        return used, pids

    try:
        used, _ = asyncio.run(asyncio.wait_for(run(), timeout=120))
        assert all(u < 0.25 for u in used), used
    finally:
        engine.shutdown()


def test_cpu_workers_get_a_passive_openmp_wait_policy_unless_set(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from cluster.engine.ray_executor import _FORWARDED_ENV, worker_env

    for name in _FORWARDED_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert worker_env("cpu") == {"HF_HUB_OFFLINE": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    assert worker_env("cuda") == {"HF_HUB_OFFLINE": "1"}
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # a user's choice is forwarded as it is
    assert worker_env("cpu")["OMP_WAIT_POLICY"] == "ACTIVE"
    assert worker_env("cuda")["OMP_WAIT_POLICY"] == "ACTIVE"


_STREAM_THEN_EXIT = """
import asyncio, ray
ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
from cluster.engine.config import EngineConfig
from cluster.engine.async_llm_engine import AsyncLLMEngine
from scheduler import SamplingParams
engine = AsyncLLMEngine(EngineConfig(model="qwen3-tiny", executor="ray"))
async def stream():
    return [o async for o in engine.generate([5, 6, 7, 8], SamplingParams(max_tokens=4), "r")]
print(len(asyncio.run(stream())), flush=True)
engine.shutdown()
"""


@pytest.mark.slow
@pytest.mark.parametrize("host_channel", ["0", "1"])
def test_a_driver_that_streamed_through_its_plan_transport_exits_cleanly(host_channel) -> None:
    """The engine task, cancelled when its event loop closes, keeps its last StepResult in a
    traceback until the interpreter exits. Read zero-copy from the compiled graph's channel,
    that result's release after the graph's teardown segfaulted the process (exit 139), so
    the executor copies results out of the channel (StepResult.owned). The same exit through
    the host channel (cluster/engine/host_channel.py), whose ranks' loops are daemon threads."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = {**os.environ, "PYTHONPATH": root, "RAY_AUTH_MODE": "disabled",
           "QWEN3_SERVE_HOST_CHANNEL": host_channel}
    out = subprocess.run([sys.executable, "-c", _STREAM_THEN_EXIT], capture_output=True,
                         text=True, timeout=300, env=env, cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "4"
