"""After start-up no Triton launch needs a kernel the start-up did not compile, checked on CPU.

Triton compiles a kernel once per key: its constexpr values, its launch options (num_warps,
num_stages), the dtypes of its pointers, and its specialisation of the other arguments (an
integer equal to 1 or divisible by 16, a pointer 16-byte aligned), unless the kernel opts out
(`do_not_specialize`, `do_not_specialize_on_alignment`). A key first met by a user's batch costs
that batch a compile of seconds (the first GPU runs' first passes after start-up).

Here every Triton launch the serving path makes is recorded, never run: `_LaunchKeys` computes
the key each launch would be compiled under for an H100 (sm_90) with Triton's own binder (what
`JITFunction.run` calls), and the model computes its results with the torch twins
(`_shadow_triton`: each kernels op is called once with the Triton backend, whose kernels only
record, and once with the torch one, whose result is used). An engine on CPU starts up as it
does on CUDA (decode graphs captured, through `EagerGraph`, then `Worker.warm_up`), then serves
batches of every kind; no key may appear after start-up. The GPU twin of this test is
tests/workers/test_cuda_step_loop.py's `test_no_triton_compile_after_start_up`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction, create_function_from_signature

import kernels
from kernels import ops
from scheduler.sampling_params import SamplingParams
from workers.cuda_graph import EagerGraph
from workers.warmup import warmup_plans
from workers.worker import Worker

_TARGET = GPUTarget("cuda", 90, 32)
_VOCAB = 2048
# ops.py's functions that dispatch to a Triton launcher
_TRITON_OPS = ("write_kv", "paged_attention", "rms_norm", "rotary_embedding",
               "qk_norm_rope_write_kv", "silu_and_mul", "sample_tokens", "fused_moe",
               "lora_shrink", "lora_expand", "fp8_block_linear")


class _LaunchKeys:
    """The compile key of every Triton launch made while `recording()`; nothing launches."""

    def __init__(self) -> None:
        self.backend = make_backend(_TARGET)
        self._binders: dict[object, tuple[Callable, list[str]]] = {}
        self.keys: dict[str, tuple[str, list[tuple[str, object]], dict]] = {}
        self.frozen: set[str] | None = None  # the keys start-up compiled
        self.new: dict[str, str] = {}  # key -> what launched it first, after start-up
        self.context = "start-up"

    def _binder(self, fn: JITFunction | InterpretedFunction) -> tuple[Callable, list[str]]:
        if fn not in self._binders:
            jit = fn if isinstance(fn, JITFunction) else JITFunction(
                fn.fn, do_not_specialize=fn.kwargs.get("do_not_specialize"),
                do_not_specialize_on_alignment=fn.kwargs.get("do_not_specialize_on_alignment"))
            binder = create_function_from_signature(jit.signature, jit.params, self.backend)
            self._binders[fn] = (binder, [p.name for p in jit.params])
        return self._binders[fn]

    def record(self, fn: JITFunction | InterpretedFunction, args: tuple, kwargs: dict) -> None:
        binder, names = self._binder(fn)
        _, specialization, options = binder(*args, **kwargs)
        name = fn.fn.__name__
        key = f"{name}{specialization}{sorted(options.items())}"
        if key not in self.keys:
            self.keys[key] = (name, list(zip(names, specialization)), options)
            if self.frozen is not None:
                self.new.setdefault(key, self.context)

    def freeze(self) -> None:
        self.frozen = set(self.keys)

    def explain(self, key: str) -> str:
        """The new key's kernel and options, and where it differs from the start-up key of the
        same kernel and options that is closest to it."""
        name, spec, options = self.keys[key]
        nearest, best = "no start-up key of this kernel", None
        for other in self.frozen or ():
            o_name, o_spec, o_options = self.keys[other]
            if o_name != name:
                continue
            diff = [f"{a[0]}: {a[1]} (start-up {b[1]})" for a, b in zip(spec, o_spec) if a != b]
            if o_options != options:
                diff.append(f"options {options} (start-up {o_options})")
            if best is None or len(diff) < best:
                best, nearest = len(diff), "; ".join(diff)
        return f"{name} {options} in {self.new[key]}: {nearest}"

    @contextmanager
    def recording(self, monkeypatch: pytest.MonkeyPatch) -> Iterator[_LaunchKeys]:
        recorder = self

        def run(fn, *args, grid, warmup, **kwargs):
            if not warmup:
                recorder.record(fn, args, kwargs)

        for cls in (JITFunction, InterpretedFunction):
            monkeypatch.setattr(cls, "run", run)
        yield self


def _shadow_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each Triton-capable op runs its Triton launcher (launches recorded, not run), then the
    torch twin, whose result the model gets."""
    monkeypatch.setattr(ops, "_resolve", lambda backend, t, allow_flash=False:
                        "triton" if backend in ("auto", "triton") else backend)
    for name in _TRITON_OPS:
        op = getattr(ops, name)

        def shadowed(*args, _op=op, backend="auto", **kwargs):
            _op(*args, backend="triton", **kwargs)
            return _op(*args, backend="torch", **kwargs)

        monkeypatch.setattr(ops, name, shadowed)
        if hasattr(kernels, name):
            monkeypatch.setattr(kernels, name, shadowed)


@pytest.fixture(scope="module")
def small_vocab_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """qwen3-tiny with a 2048-token vocabulary (divisible by 16, as Qwen3's 151,936 is: the
    sampling kernels' integer specialisations are the same), so the logits and the torch
    twins' sampling cost little."""
    from workers.tiny_model import TINY_CONFIG, write_random_qwen3

    config = dict(TINY_CONFIG, vocab_size=_VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return str(write_random_qwen3(tmp_path_factory.mktemp("ckpt") / "small-vocab", config, 0))


@pytest.fixture
def keys(monkeypatch: pytest.MonkeyPatch) -> Iterator[_LaunchKeys]:
    """Launch keys of an engine on CPU that starts up as on CUDA: decode graphs (EagerGraph),
    then the warm-up; `keys.frozen` is set when the engine is built."""
    recorder = _LaunchKeys()
    init_cache = Worker.init_cache

    def cuda_like_init_cache(self: Worker, *args, **kwargs) -> None:
        init_cache(self, *args, **kwargs)  # (on CPU: the cache only)
        if not self.config.enforce_eager:
            self.capture_graphs(EagerGraph)
        self.warm_up()
        recorder.freeze()

    monkeypatch.setattr(Worker, "init_cache", cuda_like_init_cache)
    _shadow_triton(monkeypatch)
    with recorder.recording(monkeypatch):
        yield recorder


def _prompts(rng: random.Random, n: int, lo: int, hi: int) -> list[list[int]]:
    return [[rng.randrange(3, _VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


_PARAMS = (
    dict(temperature=0.6, seed=1),
    dict(temperature=0.6),
    dict(temperature=0.0),
    dict(temperature=0.8, top_k=20),
    dict(temperature=0.8, top_p=0.9, seed=5),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=0.7, repetition_penalty=1.1),
    dict(temperature=0.0, logprobs=3),
    dict(temperature=0.6, seed=3, prompt_logprobs=2),
)


def _serve(llm, keys: _LaunchKeys, rng: random.Random) -> None:
    """Batches of every kind: decodes of 1 to 300 sequences (staggered lengths), prefills of
    odd lengths, chunked and beside decodes, plain and processed sampling rows, prefix hits."""
    def run(what: str, prompts: list[list[int]], params: list[SamplingParams]) -> None:
        keys.context = what
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    # plain rows only (the sampler's simple path), seeded and not, staggered ends
    n = 300
    run("300 plain rows", _prompts(rng, n, 1, 90),
        [SamplingParams(temperature=0.6, seed=i if i % 2 else None, max_tokens=1 + i % 37,
                        ignore_eos=True) for i in range(n)])
    # every sampling kind mixed, long prompts chunked beside decodes
    prompts = _prompts(rng, 60, 3, 1500)
    run("mixed sampling", prompts,
        [SamplingParams(**_PARAMS[i % len(_PARAMS)], max_tokens=1 + i % 13, ignore_eos=True)
         for i in range(len(prompts))])
    # prefix hits: the same prompts again, whole and extended
    again = [p + _prompts(rng, 1, 0, 40)[0] for p in prompts[:30]] + prompts[30:45]
    run("prefix hits", again,
        [SamplingParams(temperature=0.6, seed=i, max_tokens=1 + i % 5, ignore_eos=True)
         for i in range(len(again))])
    for b in (1, 2, 3, 5, 7, 9, 17, 31, 64, 127):
        run(f"{b} greedy rows", _prompts(rng, b, 1, 300),
            [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)] * b)


# (the GPU's defaults: decode graphs and async scheduling; and neither)
@pytest.mark.parametrize(("enforce_eager", "async_scheduling"), [(False, True), (True, False)])
def test_no_new_launch_key_after_start_up(small_vocab_dir: str, keys: _LaunchKeys,
                                          enforce_eager: bool, async_scheduling: bool) -> None:
    from cluster import LLM

    with LLM(small_vocab_dir, device="cpu", dtype="bfloat16", max_num_seqs=300,
             max_model_len=4096, max_num_batched_tokens=2048, num_gpu_blocks_override=4096,
             attention_backend="triton", enforce_eager=enforce_eager,
             async_scheduling=async_scheduling) as llm:
        assert keys.frozen, "the engine's start-up launched no Triton kernel"
        _serve(llm, keys, random.Random(0))
    assert not keys.new, "new Triton compile keys after start-up:\n" + "\n".join(
        keys.explain(k) for k in keys.new)


@pytest.mark.parametrize(("max_num_seqs", "num_kv_heads", "max_model_len"),
                         [(64, 8, 2048), (300, 2, 4096), (8, 2, 200), (1, 1, 64)])
def test_decode_launch_shapes_cover_every_split_k_factor(max_num_seqs: int, num_kv_heads: int,
                                                         max_model_len: int) -> None:
    """What the warm-up runs for decode: one batch per split-K factor that some decode batch
    within the limits gets, each picking that factor itself (a kernel compiled per factor)."""
    from kernels.attention_split import (
        TILE_N,
        choose_num_segments,
        decode_launch_shapes,
        device_sm_count,
    )

    cpu = torch.device("cpu")
    sms = device_sm_count(cpu)  # (the nominal count off-GPU, as the launcher uses)
    shapes = decode_launch_shapes(max_num_seqs, num_kv_heads, max_model_len, cpu)
    chosen = [choose_num_segments(b, num_kv_heads, 1, n, TILE_N, sms) for b, n in shapes]
    # (every 7th length: the choice follows the count of 64-key tiles)
    reachable = {choose_num_segments(b, num_kv_heads, 1, n, TILE_N, sms)
                 for b in range(1, max_num_seqs + 1) for n in range(1, max_model_len + 1, 7)}
    assert sorted(chosen) == sorted(reachable)
    assert all(b <= max_num_seqs and n <= max_model_len for b, n in shapes)


def test_warm_up_runs_each_decode_shape_eagerly() -> None:
    """Each decode shape becomes one step of one-token rows, its longest sequence as long as
    the shape says, none sampling (so it never replays a graph), full-length ones included."""
    shapes = [(23, 320), (1, 4096)]
    plans = list(warmup_plans(16, 400, 4096, 2048, 300, eager_decode=False,
                              decode_shapes=shapes))
    decodes = [p for p in plans if p.num_seqs and not p.do_sample.any()]
    assert [(p.num_seqs, int((p.start_pos + p.query_lens).max())) for p in decodes] == shapes
    assert all((p.query_lens == 1).all() for p in decodes)
    assert plans[-1].num_seqs == 0  # (the warm-up ends holding no sequence)
