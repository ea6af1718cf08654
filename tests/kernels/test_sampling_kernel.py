"""`kernels.ops.sample_tokens`: the Triton kernel and the CPU's C++ op (`kernels/csrc/
sample_cpu.cpp`, what "auto" runs on CPU) against their torch twin, token for token, and the
draw's edges (the lowest and highest uniforms, -inf masks, ragged chunks) on each.

CPU cases run the Triton kernel under Triton's interpreter at small vocabularies, the C++ op at
those and at Qwen3's; the `gpu` cases run the kernel at Qwen3's vocabulary in bf16, and inside a
CUDA graph.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor

from kernels import cpu_extension, ops
from kernels.reference import SAMPLE_CHUNK, uniform

INTERPRETER = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU tensors need Triton's interpreter, which is off when CUDA is present; "
           "the gpu cases below run the kernel there")
NEG = float("-inf")
_M64 = (1 << 64) - 1


def key_for_uniform(bits: int, counter: int) -> int:
    """The int64 stream key whose uniform at `counter` is `bits * 2**-53` (splitmix64's
    finaliser is a bijection: run it backwards)."""

    def unxorshift(y: int, s: int) -> int:
        x = y
        for _ in range(64 // s + 1):
            x = y ^ (x >> s)
        return x

    x = unxorshift(bits << 11, 31)
    x = unxorshift((x * pow(0x94D049BB133111EB, -1, 1 << 64)) & _M64, 27)
    x = unxorshift((x * pow(0xBF58476D1CE4E5B9, -1, 1 << 64)) & _M64, 30)
    key = x ^ ((counter * 0x9E3779B97F4A7C15) & _M64)
    return key - (1 << 64) if key >= 1 << 63 else key


# The smallest and largest uniforms and a few inside, as their top 53 bits.
U_EDGES = [0, 1, 1 << 51, 1 << 52, (1 << 53) - 2, (1 << 53) - 1]


def test_key_for_uniform_inverts_the_stream() -> None:
    keys = torch.tensor([key_for_uniform(b, 7) for b in U_EDGES])
    got = uniform(keys, torch.full((len(U_EDGES),), 7)).tolist()
    assert got == [b * 2.0 ** -53 for b in U_EDGES]


def _random_case(rows: int, vocab: int, dtype: torch.dtype, device: str, seed: int
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Logits with the shapes a sampler meets: wide and flat rows, -inf masks (a grammar's,
    top-k's), whole masked chunks, a single allowed token, greedy rows, ties for the max."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 4
    x[1, : vocab // 2] = NEG  # the first half of the chunks hold nothing
    x[2, vocab // 3:] = NEG  # ... the last ones nothing
    x[3] = NEG
    x[3, vocab - 1] = 0.0  # one token, in the ragged tail when there is one
    x[4, torch.randperm(vocab, generator=g)[: vocab - 5]] = NEG  # top-k-like: 5 survive
    x[5] = 0.0  # flat
    x[6, [7, vocab - 3]] = 30.0  # a tie for the maximum across chunks
    temperature = torch.rand(rows, generator=g) * 1.5 + 0.05
    temperature[::5] = 0.0  # greedy rows: 0, 5, 10, ...
    temperature[6] = 0.0
    keys = torch.randint(-2 ** 63, 2 ** 63 - 1, (rows,), generator=g)
    counters = torch.randint(0, 1 << 20, (rows,), generator=g)
    return (x.to(dtype).to(device), temperature.to(device), keys.to(device),
            counters.to(device))


def check_kernel_equals_twin(rows: int, vocab: int, dtype: torch.dtype, device: str,
                             seed: int, backend: str = "triton") -> None:
    x, temperature, keys, counters = _random_case(rows, vocab, dtype, device, seed)
    for t in (temperature, None):
        want = ops.sample_tokens(x, keys, counters, t, backend="torch")
        got = ops.sample_tokens(x, keys, counters, t, backend=backend)
        assert got.dtype == torch.int64 and got.device == x.device
        assert got.tolist() == want.tolist()
        assert bool(torch.isfinite(x.float().gather(1, got[:, None])).all())
        if t is not None:  # greedy rows: the first maximum
            greedy = t == 0
            assert torch.equal(got[greedy], x.float().argmax(dim=-1)[greedy])


@INTERPRETER
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("vocab", [1000, 1024, 200, 77])  # ragged, whole, 2 chunks, < 1 chunk
def test_kernel_equals_twin_token_for_token(vocab: int, dtype: torch.dtype) -> None:
    check_kernel_equals_twin(12, vocab, dtype, "cpu", seed=vocab)


@INTERPRETER
def test_kernel_many_chunks_and_batch_sizes() -> None:
    """More chunks than one step of the pick kernel's running sum (1024 chunks), and a row's
    token the same alone (fewer chunks per program) as in a batch."""
    from kernels import triton_sampling

    vocab = (triton_sampling._PICK_BLOCK + 3) * SAMPLE_CHUNK - 5
    x, temperature, keys, counters = _random_case(10, vocab, torch.float32, "cpu", seed=3)
    x[7, : vocab - 200] = NEG  # the only mass lies in the second step of the sum
    want = ops.sample_tokens(x, keys, counters, temperature, backend="torch")
    got = ops.sample_tokens(x, keys, counters, temperature, backend="triton")
    assert got.tolist() == want.tolist()
    alone = [int(ops.sample_tokens(x[r:r + 1], keys[r:r + 1], counters[r:r + 1],
                                   temperature[r:r + 1], backend="triton")) for r in (5, 7, 8)]
    assert alone == [int(got[r]) for r in (5, 7, 8)]


@pytest.fixture
def cpu_op(monkeypatch: pytest.MonkeyPatch) -> object:
    """The C++ sampling op, built here if it is not yet and looked up afresh."""
    cpu_extension.build(quiet=True)
    monkeypatch.setattr(cpu_extension, "_loaded", {})
    op = cpu_extension.sample_rows()
    assert op is not None
    return op


@pytest.mark.parametrize("vocab", [1000, 1024, 200, 77, 151936])
def test_cpu_op_equals_twin_token_for_token(cpu_op: object, vocab: int,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setitem(cpu_extension._loaded, "sample_rows",
                        lambda x, *a: calls.append(x.shape[0]) or cpu_op(x, *a))
    check_kernel_equals_twin(12, vocab, torch.float32, "cpu", seed=vocab, backend="auto")
    assert calls == [12, 12]  # "auto" on CPU ran the op (with and without temperatures)


def test_cpu_op_many_rows_at_qwen3_vocab_and_alone(cpu_op: object) -> None:
    """64 rows of Qwen3's vocabulary at temperatures 0.05-2 (no greedy row): the twin's tokens;
    a row's token the same alone as in the batch (rows run on any thread)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(64, 151936, generator=g) * 3
    t = torch.rand(64, generator=g) * 1.95 + 0.05
    keys = torch.randint(-2 ** 63, 2 ** 63 - 1, (64,), generator=g)
    counters = torch.arange(64) * 7
    want = ops.sample_tokens(x, keys, counters, t, backend="torch")
    got = ops.sample_tokens(x, keys, counters, t)
    assert got.tolist() == want.tolist()
    alone = [int(ops.sample_tokens(x[r:r + 1], keys[r:r + 1], counters[r:r + 1], t[r:r + 1]))
             for r in (0, 31, 63)]
    assert alone == [int(got[r]) for r in (0, 31, 63)]
    # a non-float32 or column-strided input goes to the twin (same tokens)
    assert ops.sample_tokens(x.T.contiguous().T, keys, counters, t).tolist() == want.tolist()


@pytest.mark.parametrize("backend", [
    "torch", "auto", pytest.param("triton", marks=INTERPRETER)])
def test_draw_edges_of_the_uniform_land_on_allowed_tokens(backend: str) -> None:
    if backend == "auto":  # on CPU: the C++ op
        cpu_extension.build(quiet=True)
    vocab = 1000  # 7 chunks of 128 and a ragged one of 104
    rows = len(U_EDGES)
    x = torch.full((rows, vocab), NEG)
    allowed = [3, 517, 518, 999]
    x[:, allowed] = torch.tensor([0.0, 5.0, -3.0, 1.0])
    keys = torch.tensor([key_for_uniform(b, 5) for b in U_EDGES])
    tokens = ops.sample_tokens(x, keys, torch.full((rows,), 5), backend=backend).tolist()
    assert tokens[0] == 3 and tokens[-1] == 999  # the lowest and the highest ends of the CDF
    # u = 1/4 and 1/2 fall in token 517 (it holds 0.7% .. 99.3% of the mass)
    assert tokens[2:4] == [517, 517] and set(tokens) <= set(allowed)
    # The last allowed token sits before masked chunks: the top uniform still picks it.
    x[:, 999] = NEG
    tokens = ops.sample_tokens(x, keys, torch.full((rows,), 5), backend=backend).tolist()
    assert tokens[-1] == 518 and set(tokens) <= set(allowed[:3])


def test_bad_arguments_name_what_to_change() -> None:
    x = torch.zeros(2, 10)
    keys = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="rng_counter must be int64"):
        ops.sample_tokens(x, keys, torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="temperature must be float32"):
        ops.sample_tokens(x, keys, keys, torch.zeros(3))
    with pytest.raises(ValueError, match="logits must be a float"):
        ops.sample_tokens(torch.zeros(2, 10, dtype=torch.int64), keys, keys)


@pytest.mark.slow
def test_kernels_compile_for_h100(tmp_path: Path) -> None:
    """Without a GPU, the kernels still pass Triton's front end, LLVM and ptxas for sm_90."""
    here = Path(__file__).resolve().parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from a warm cache
    env["PYTHONPATH"] = os.pathsep.join([str(here.parents[1]), str(here)])
    result = subprocess.run([sys.executable, str(here / "sm90_compile_sampling.py")], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip().endswith("compiled for sm_90")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 256])
def test_kernel_equals_twin_on_cuda_at_qwen3_vocab(rows: int, dtype: torch.dtype) -> None:
    check_kernel_equals_twin(rows + 6, 151936, dtype, "cuda", seed=rows)


@pytest.mark.gpu
def test_sample_simple_runs_inside_a_cuda_graph() -> None:
    from workers.sampler import sample_simple

    x, temperature, keys, counters = _random_case(32, 151936, torch.bfloat16, "cuda", seed=9)
    out = sample_simple(x, temperature, keys, counters)  # compiles the kernels first
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        captured = sample_simple(x, temperature, keys, counters)
    torch.cuda.current_stream().wait_stream(stream)
    for step in range(3):  # new counters and logits in place, as the decode loop feeds them
        counters.add_(1)
        x.mul_(0.9)
        graph.replay()
        want = ops.sample_tokens(x, keys, counters, temperature, backend="torch")
        assert captured.tolist() == want.tolist(), step
    assert out.shape == (32,)
