"""lm-evaluation-harness, unmodified, against this server: its `local-completions` model over
the project's HTTP app (served by uvicorn on a free port in this process, an AsyncLLMEngine on
qwen3-tiny behind it) and its own `hf` model on the same checkpoint (fp32, CPU) run the same
local tasks, written by the test (JSONL datasets and task YAMLs under tmp_path): every
per-choice loglikelihood equal within 2e-3 with the same is_greedy flags and the same
accuracy on a multiple-choice task, and the same greedy generations on a generate_until task.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lm_eval
import pytest

from cluster.api.engine_client import LocalEngineClient
from cluster.api.openai_api import create_app
from cluster.engine.async_llm_engine import AsyncLLMEngine
from cluster.engine.config import EngineConfig

pytestmark = pytest.mark.slow

ATOL = 2e-3

QUESTIONS = [
    ("What is the capital of France?", ["Paris", "Berlin", "Madrid", "Rome"], 0),
    ("How many legs does a spider have?", ["six", "eight", "ten", "four"], 1),
    ("Which planet is closest to the Sun?", ["Venus", "Earth", "Mercury", "Mars"], 2),
    ("What colour is a clear daytime sky?", ["green", "red", "yellow", "blue"], 3),
    ("What is two plus three?", ["five", "four", "six", "seven"], 0),
    ("Which animal says moo?", ["a dog", "a cow", "a cat", "a duck"], 1),
    ("What do bees make?", ["milk", "silk", "honey", "wool"], 2),
    ("Which is the largest ocean?", ["Arctic", "Indian", "Atlantic", "Pacific"], 3),
    ("What freezes at zero degrees Celsius?", ["water", "iron", "gold", "salt"], 0),
    ("Which month comes after June?", ["May", "July", "August", "March"], 1),
]
PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Once upon a time, in a small village"]


def write_tasks(root: Path) -> None:
    """A 10-question multiple-choice task and a 3-prompt greedy generate_until task, each a
    JSONL file loaded by `datasets`' json builder and a task YAML beside it."""
    mc = root / "mc.jsonl"
    mc.write_text("".join(json.dumps({"question": q, "choices": c, "label": a}) + "\n"
                          for q, c, a in QUESTIONS))
    gen = root / "gen.jsonl"
    gen.write_text("".join(json.dumps({"prompt": p, "target": ""}) + "\n" for p in PROMPTS))
    cache = root / "datasets-cache"
    (root / "tiny_mc.yaml").write_text(f"""\
task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {mc}
  cache_dir: {cache}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
""")
    (root / "tiny_gen.yaml").write_text(f"""\
task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {gen}
  cache_dir: {cache}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 12
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
""")


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    """The project's app over a real engine on qwen3-tiny, served by uvicorn on a free port."""
    import uvicorn

    engine = AsyncLLMEngine(EngineConfig(model="qwen3-tiny", max_num_seqs=8))
    app = create_app(LocalEngineClient(engine), engine.tokenizer)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/v1/completions"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
        engine.shutdown()


def evaluate(model: str, model_args: str, tasks_dir: Path) -> dict[str, Any]:
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(tasks_dir), include_defaults=False)
    results = lm_eval.simple_evaluate(model=model, model_args=model_args,
                                      tasks=["tiny_mc", "tiny_gen"], task_manager=manager,
                                      log_samples=True, bootstrap_iters=0)
    assert results is not None
    return results


def by_doc(results: dict[str, Any], task: str) -> list[dict[str, Any]]:
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])


def test_local_completions_matches_lm_evals_hf_model(server_url: str, tiny_model_path: str,
                                                     tmp_path: Path) -> None:
    write_tasks(tmp_path)
    served = evaluate("local-completions",
                      f"model=qwen3-tiny,base_url={server_url},tokenizer={tiny_model_path},"
                      "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1",
                      tmp_path)
    oracle = evaluate("hf", f"pretrained={tiny_model_path},dtype=float32,device=cpu,"
                            "batch_size=4", tmp_path)

    got, want = by_doc(served, "tiny_mc"), by_doc(oracle, "tiny_mc")
    assert len(got) == len(want) == len(QUESTIONS)
    lls = []
    for g, w in zip(got, want):
        assert g["doc_id"] == w["doc_id"] and len(g["resps"]) == len(w["resps"]) == 4
        for (g_ll, g_greedy), (w_ll, w_greedy) in (
                (gr[0], wr[0]) for gr, wr in zip(g["resps"], w["resps"])):
            assert abs(g_ll - w_ll) <= ATOL, (g["doc_id"], g_ll, w_ll)
            assert g_greedy == w_greedy
            lls.append(w_ll)
        assert g["acc"] == w["acc"]
    assert len(set(lls)) > len(QUESTIONS), "the choices' loglikelihoods should differ"
    assert all(ll < 0 for ll in lls)
    acc = served["results"]["tiny_mc"]["acc,none"]
    assert acc == oracle["results"]["tiny_mc"]["acc,none"]
    assert acc == sum(s["acc"] for s in want) / len(QUESTIONS)

    got, want = by_doc(served, "tiny_gen"), by_doc(oracle, "tiny_gen")
    assert len(got) == len(want) == len(PROMPTS)
    for g, w in zip(got, want):
        assert g["resps"] == w["resps"]
        assert w["resps"][0][0], "a greedy generation of at least one character"
