"""`python -m cluster.batch IN OUT --model M [engine args]` (`./dev batch IN OUT`): an OpenAI
batch file through engine replicas on Ray Data, its results in OpenAI's batch output format.

Runs on a local Ray started here (fractional CPUs for the tokenizer stage) or, when
RAY_ADDRESS is set, on that cluster (IN must then be readable from its nodes: a shared path).
Ray Data's progress bars show the stages; at the end one summary line goes to stderr:
rows, failed, output tokens per second of wall time. Output lines come in the order their
requests finish, each naming its `custom_id`. Exit status: 0 when the job ran (failed lines
included), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
from typing import Any

import yaml

from cluster.batch.config import ProcessorConfig
from cluster.batch.openai_batch import ModelFacts, read_request, write_result
from cluster.batch.processor import build_processor
from cluster.engine.config import EngineConfig


def _concurrency(text: str) -> int | tuple[int, int]:
    low, _, high = text.partition(",")
    try:
        return (int(low), int(high)) if high else int(low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: an integer N or MIN,MAX") from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cluster.batch", description=__doc__.split("\n")[0])
    p.add_argument("input", help="OpenAI batch input: one JSON request per line")
    p.add_argument("output", help="where the results go, one JSON line per request")
    p.add_argument("--concurrency", type=_concurrency, default=1,
                   help="engine replicas: N, or MIN,MAX to autoscale (default 1)")
    for name in ("batch_size", "max_batches_in_flight"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int,
                       default=ProcessorConfig.__dataclass_fields__[name].default)
    p.add_argument("--engine-num-cpus", type=float, default=1.0,
                   help="CPUs each engine replica asks Ray for (default 1)")
    p.add_argument("--engine-num-gpus", type=float, default=None,
                   help="GPUs each engine replica asks Ray for (default: 1 for tp 1 on a cluster "
                        "with GPUs, else 0; tp > 1 workers take theirs)")
    p.add_argument("--served-model-name", default=None,
                   help="the `model` of the response bodies (default: --model)")
    engine = p.add_argument_group("engine arguments (EngineConfig's fields; values in YAML)")
    for f in dataclasses.fields(EngineConfig):
        engine.add_argument(f"--{f.name.replace('_', '-')}", dest=f"engine.{f.name}",
                            metavar=f.name.upper(), type=yaml.safe_load,
                            default=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = vars(parser().parse_args(argv))
    engine_kwargs = {k.removeprefix("engine."): v for k, v in args.items()
                     if k.startswith("engine.")}
    try:
        config = ProcessorConfig(engine_kwargs=engine_kwargs, concurrency=args["concurrency"],
                                 batch_size=args["batch_size"],
                                 max_batches_in_flight=args["max_batches_in_flight"],
                                 engine_num_cpus=args["engine_num_cpus"],
                                 engine_num_gpus=args["engine_num_gpus"],
                                 apply_chat_template=False, tokenize=False)
        parsers = sorted(k for k in ("reasoning_parser", "tool_call_parser")
                         if engine_kwargs.get(k) is not None)
        if parsers:  # the result bodies would silently lack reasoning_content / tool_calls
            raise ValueError(f"{parsers[0]} is not supported by batch jobs yet; remove it")
        if not os.path.isfile(args["input"]):
            raise ValueError(f"input {args['input']!r} is not a file")
        facts = ModelFacts.of(config.engine_config())
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    served = args["served_model_name"] or facts.model
    import ray
    import ray.data

    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(log_to_driver=False)
        else:
            # "local": a new Ray of this job's own; without it ray.init joins whatever
            # cluster another program on this machine started last.
            ray.init("local", num_cpus=os.cpu_count(), include_dashboard=False,
                     log_to_driver=False)
    processor = build_processor(config, preprocess=functools.partial(read_request, facts=facts),
                                postprocess=functools.partial(write_result, model=served,
                                                              pooling=facts.pooling))
    summary = run(processor(ray.data.read_text(os.path.abspath(args["input"]))), args["output"])
    print(summary, file=sys.stderr)
    return 0


def run(ds: Any, output: str) -> str:
    """Write every result line of `ds` to `output`; the summary line."""
    start = time.perf_counter()
    rows = failed = tokens = 0
    with open(output, "w") as out:
        for row in ds.iter_rows():
            out.write(row["line"] + "\n")
            rows += 1
            failed += bool(row["failed"])
            tokens += row["tokens"]
    wall = time.perf_counter() - start
    return (f"batch: {rows} rows, {failed} failed, {tokens} output tokens in {wall:.1f} s "
            f"({tokens / wall:.1f} output tok/s)")


if __name__ == "__main__":
    sys.exit(main())
