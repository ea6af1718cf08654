"""StructuredOutputManager on its own (no engine): compiling, matchers, bitmasks, the hooks.

Generation is simulated by a random walk: each step draws a token uniformly from the ones the
bitmask allows, as a sampler at temperature "infinity" would; whatever it draws must end as
an output that satisfies the constraint.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import jsonschema
import numpy as np
import pytest

from cluster.engine.grammar import MAX_JSON_WHITESPACE, check_schema
from cluster.engine.structured_output import StructuredOutputManager
from scheduler import CompletionOutput, NewSeq, RequestOutput, SamplingParams, StepPlan, StepResult
from scheduler.sampling_params import StructuredOutputsParams as SO

VOCAB = 151936  # Qwen3's logits width (the tokenizer has 151,669 tokens)
EOS = (151645, 151643)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def manager(tokenizer: Any) -> StructuredOutputManager:
    return StructuredOutputManager(tokenizer, VOCAB, EOS)


def allowed(row: np.ndarray) -> np.ndarray:
    """The token ids a bitmask row allows."""
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))


def walk(manager: StructuredOutputManager, seq_id: int, rng: np.random.Generator,
         max_steps: int = 200) -> list[int]:
    """Draw allowed tokens until a stop token; the tokens before it."""
    out = []
    for _ in range(max_steps):
        token = int(rng.choice(allowed(manager.fill([seq_id])[0])))
        assert manager.accept(seq_id, [token])
        if token in EOS:
            return out
        out.append(token)
    raise AssertionError(f"no stop token within {max_steps} tokens")


def constrain(manager: StructuredOutputManager, spec: SO, request_id: str, seq_id: int,
              index: int = 0) -> None:
    manager.add_request(request_id, spec)
    manager.add_seq(seq_id, request_id, index)


BOUNDED_SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"},
                                      "n": {"type": "integer", "minimum": -5, "maximum": 5}},
     "required": ["ok", "n"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"point": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}},
     "required": ["point"], "additionalProperties": False},
    {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 2}]},
]


@pytest.mark.parametrize("schema", BOUNDED_SCHEMAS)
def test_random_walk_output_validates_against_schema(manager: StructuredOutputManager,
                                                     tokenizer: Any, schema: dict) -> None:
    rng = np.random.default_rng(0)
    for k in range(3):
        rid = f"schema-{json.dumps(schema)}-{k}"
        constrain(manager, SO(json=schema), rid, 1000 + k)
        text = tokenizer.decode(walk(manager, 1000 + k, rng))
        jsonschema.validate(json.loads(text), schema)
        manager.release(rid)


def test_regex_and_choice_walks_match_exactly(manager: StructuredOutputManager,
                                              tokenizer: Any) -> None:
    rng = np.random.default_rng(1)
    constrain(manager, SO(regex=r"[a-c]{2}-\d{1,3}"), "re", 1)
    for _ in range(3):
        text = tokenizer.decode(walk(manager, 1, rng))
        assert re.fullmatch(r"[a-c]{2}-\d{1,3}", text), text
        manager.release("re")
        constrain(manager, SO(regex=r"[a-c]{2}-\d{1,3}"), "re", 1)
    manager.release("re")
    choices = ['say "hi"', "back\\slash", "naïve ünï", "two\nlines", "say"]
    seen = set()
    for k in range(12):
        constrain(manager, SO(choice=choices), f"c{k}", 2)
        text = tokenizer.decode(walk(manager, 2, rng))
        assert text in choices
        seen.add(text)
        manager.release(f"c{k}")
    assert len(seen) >= 3  # the walk reaches several of them, not one by construction


def test_json_whitespace_is_bounded_or_off(manager: StructuredOutputManager,
                                           tokenizer: Any) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    constrain(manager, SO(json=schema), "ws", 3)
    assert manager.accept(3, tokenizer.encode("{" + " " * MAX_JSON_WHITESPACE,
                                              add_special_tokens=False))
    # one more space is refused: only the key's quote can follow
    space = tokenizer.encode(" ", add_special_tokens=False)[0]
    assert space not in allowed(manager.fill([3])[0])
    manager.release("ws")
    constrain(manager, SO(json=schema, disable_any_whitespace=True), "compact", 4)
    assert manager.accept(4, tokenizer.encode('{"a":', add_special_tokens=False))
    assert space not in allowed(manager.fill([4])[0])
    manager.release("compact")


def test_bitmask_spans_the_model_vocab_and_never_allows_padding_ids(
        manager: StructuredOutputManager, tokenizer: Any) -> None:
    constrain(manager, SO(json_object=True), "vocab", 5)
    assert manager.accept(5, tokenizer.encode('{"k": "', add_special_tokens=False))
    mask = manager.fill([5])
    assert mask.shape == (1, -(-VOCAB // 32)) and mask.dtype == np.int32
    ids = allowed(mask[0])
    assert len(ids) > 100_000 and ids.max() < len(tokenizer)  # inside a string: nearly all
    manager.release("vocab")


def test_terminated_matcher_allows_only_stop_tokens(manager: StructuredOutputManager,
                                                    tokenizer: Any) -> None:
    constrain(manager, SO(choice=["yes"]), "term", 6)
    assert manager.accept(6, tokenizer.encode("yes", add_special_tokens=False))
    assert set(allowed(manager.fill([6])[0])) == set(EOS)
    assert manager.accept(6, [EOS[0]])
    # ignore_eos / min_tokens keep such a sequence going: it may only repeat a stop token
    assert set(allowed(manager.fill([6])[0])) == set(EOS)
    assert manager.accept(6, [EOS[1], EOS[0]])
    manager.release("term")


def test_refused_token_is_reported_and_skipped(manager: StructuredOutputManager,
                                               tokenizer: Any) -> None:
    constrain(manager, SO(choice=["yes"]), "bad", 7)
    assert not manager.accept(7, tokenizer.encode("no", add_special_tokens=False))
    assert manager.accept(7, tokenizer.encode("yes", add_special_tokens=False))
    manager.release("bad")


def test_rollback_restores_the_earlier_bitmask(manager: StructuredOutputManager,
                                               tokenizer: Any) -> None:
    constrain(manager, SO(json=BOUNDED_SCHEMAS[0]), "rb", 8)
    manager.accept(8, tokenizer.encode('{"ok": ', add_special_tokens=False))
    before = manager.fill([8]).copy()
    more = tokenizer.encode('true, "n": ', add_special_tokens=False)
    assert manager.accept(8, more)
    assert not np.array_equal(manager.fill([8]), before)
    manager.rollback(8, len(more))
    assert np.array_equal(manager.fill([8]), before)
    manager.release("rb")


def test_reasoning_block_may_open_the_output(manager: StructuredOutputManager,
                                             tokenizer: Any) -> None:
    spec = SO(json=BOUNDED_SCHEMAS[0], reasoning=True)
    constrain(manager, spec, "think", 9)
    think = tokenizer.convert_tokens_to_ids("<think>")
    first = allowed(manager.fill([9])[0])
    assert think in first and tokenizer.encode("{", add_special_tokens=False)[0] in first
    text = '<think>\nany words { here</think>\n\n{"ok": false, "n": -5}'
    assert manager.accept(9, tokenizer.encode(text, add_special_tokens=False))
    assert set(allowed(manager.fill([9])[0])) == set(EOS)
    manager.release("think")
    constrain(manager, spec, "direct", 10)  # or the constrained part right away
    assert manager.accept(10, tokenizer.encode('{"ok": true, "n": 0}', add_special_tokens=False))
    assert set(allowed(manager.fill([10])[0])) == set(EOS)
    manager.release("direct")


@pytest.mark.parametrize("spec, message", [
    (SO(json={"type": "frobnicate"}), "json constraint does not compile: Unsupported type"),
    (SO(json={"type": "object", "minProperties": 2}), "does not compile"),
    (SO(regex="a(b"), "regex constraint does not compile: Regex parsing error"),
    (SO(grammar="root ::= missing"), 'grammar constraint does not compile: EBNF parser error'),
    (SO(json={"type": "array", "uniqueItems": True}), "uses uniqueItems at $"),
    (SO(json={"type": "object", "properties": {"a": {"not": {"type": "string"}}}}),
     "uses not at $.properties.a"),
    (SO(json={"type": "number", "multipleOf": 0.5}), "uses multipleOf"),
    (SO(json={"type": "string", "pattern": "^a+$", "maxLength": 3}),
     "uses minLength/maxLength together with pattern"),
])
def test_bad_constraint_is_a_value_error_without_source_paths(
        manager: StructuredOutputManager, spec: SO, message: str) -> None:
    with pytest.raises(ValueError) as info:
        manager.compile(spec)
    assert message in str(info.value)
    assert ".cc:" not in str(info.value) and "/project" not in str(info.value)


def test_schema_check_reads_property_names_as_names() -> None:
    check_schema({"type": "object", "properties": {"not": {"type": "string"},
                                                   "if": {"enum": [{"not": 1}]}}})


# Each keyword check_schema refuses, with a value the schema forbids: xgrammar accepts the
# value all the same (if this test fails, xgrammar enforces the keyword now: allow it).
_UNENFORCED = [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
    ({"not": {"type": "string"}}, '"a"'),
    ({"if": {"type": "string"}, "then": {"maxLength": 2}}, '"abc"'),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "1"),
    ({"type": "number", "multipleOf": 0.5}, "0.3"),
]


@pytest.mark.parametrize("schema, forbidden", _UNENFORCED)
def test_refused_keywords_are_ones_xgrammar_does_not_enforce(
        manager: StructuredOutputManager, schema: dict, forbidden: str) -> None:
    import xgrammar as xgr

    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(forbidden), schema)
    with pytest.raises(ValueError):
        check_schema(schema)
    grammar = manager._get_compiler().compile_json_schema(json.dumps(schema))
    matcher = xgr.GrammarMatcher(grammar)
    assert matcher.accept_string(forbidden) and matcher.is_completed()


def test_compiles_once_per_constraint(manager: StructuredOutputManager) -> None:
    a = manager.compile(SO(json={"type": "integer"}))
    assert manager.compile(SO(json='{"type": "integer"}')) is a  # text or dict: one key
    assert manager.compile(SO(json={"type": "integer"}, disable_any_whitespace=True)) is not a


def test_compile_async_shares_one_compile_and_times_out_cleanly(tokenizer: Any) -> None:
    slow = StructuredOutputManager(tokenizer, VOCAB, EOS, compile_timeout_s=0.001)
    with pytest.raises(ValueError, match="did not compile within 0.001 s"):
        slow.compile(SO(regex="x+"))  # the first compile builds the tokenizer info: ~1 s
    fresh = StructuredOutputManager(tokenizer, VOCAB, EOS)
    spec = SO(json={"type": "boolean"})

    async def both() -> None:
        await asyncio.gather(fresh.compile_async(spec), fresh.compile_async(spec))

    asyncio.run(both())
    assert len(fresh._grammars) == 1 and not fresh._compiling

    async def one_gives_up() -> None:  # (a client gone while its schema compiles)
        spec = SO(json={"type": "array", "items": {"type": "boolean"}})
        quitter = asyncio.ensure_future(fresh.compile_async(spec))
        stayer = asyncio.ensure_future(fresh.compile_async(spec))
        await asyncio.sleep(0)
        quitter.cancel()
        await stayer  # the shared compile goes on for the one that stayed

    asyncio.run(one_gives_up())
    assert len(fresh._grammars) == 2
    with pytest.raises(ValueError, match="regex constraint does not compile"):
        asyncio.run(fresh.compile_async(SO(regex="(")))


def _plan(step_id: int, seq_ids: list[int], do_sample: list[bool],
          new: list[tuple[int, str, int]] = ()) -> StepPlan:
    n = len(seq_ids)
    return StepPlan(step_id=step_id, seq_ids=np.array(seq_ids, dtype=np.int64),
                    query_lens=np.ones(n, dtype=np.int32), start_pos=np.zeros(n, dtype=np.int32),
                    input_ids=np.zeros(n, dtype=np.int64), do_sample=np.array(do_sample),
                    new_seqs=[NewSeq(sid, rid, idx, 1, [], [0], SamplingParams())
                              for sid, rid, idx in new])


def test_hooks_follow_sequences_from_plans_through_results(
        manager: StructuredOutputManager, tokenizer: Any) -> None:
    spec = SO(choice=["ab", "ba"])
    manager.add_request("req", spec)  # n = 2: samples 0 and 1, seq ids 21 and 22
    a, b, ab, ba = (tokenizer.convert_tokens_to_ids(t) for t in ("a", "b", "ab", "ba"))
    # Batch: 20 (unconstrained, samples), 21 (constrained), 23 (prefill chunk, no sample), 22.
    plan = _plan(1, [20, 21, 23, 22], [True, True, False, True],
                 new=[(20, "other", 0), (21, "req", 0), (22, "req", 1), (23, "other2", 0)])
    manager.mark(plan)
    assert plan.constrained_rows.tolist() == [1, 2]  # among the sampled rows
    first = manager.bitmask(plan)
    assert [set(allowed(r)) for r in first] == [{a, b, ab, ba}] * 2
    result = StepResult(1, np.array([20, 21, 22]), np.array([7, a, b]))
    manager.on_result(plan, result, [])
    plan2 = _plan(2, [20, 21, 22], [True, True, True])
    manager.mark(plan2)
    assert [set(allowed(r)) for r in manager.bitmask(plan2)] == [{b}, {a}]
    # Sample 0 stops (a stop string, say) with step 2; sample 1's token arrives.
    result2 = StepResult(2, np.array([20, 21, 22]), np.array([7, b, a]))
    done0 = RequestOutput("req", [1], [CompletionOutput(0, [b], "ab", "stop", None),
                                       CompletionOutput(1, [a], "a", None, None)], False)
    manager.on_result(plan2, result2, [done0])
    # A plan scheduled ahead (async) still has a row for sample 0: it gets all ones.
    plan3 = _plan(3, [21, 22], [True, True])
    manager.mark(plan3)
    assert plan3.constrained_rows.tolist() == [1]
    assert set(allowed(manager.bitmask(plan3)[0])) == set(EOS)
    manager.on_result(plan3, StepResult(3, np.array([21, 22]), np.array([0, EOS[0]])),
                      [RequestOutput("req", [1], [CompletionOutput(1, [EOS[0]], "", "stop",
                                                                   None)], True)])
    assert not manager.active
    plan4 = _plan(4, [21, 22], [True, True])
    manager.mark(plan4)
    assert plan4.num_constrained == 0
    assert np.array_equal(manager.fill([22]), np.full((1, manager.words), -1, dtype=np.int32))


def test_preempted_sample_keeps_its_matcher(manager: StructuredOutputManager,
                                            tokenizer: Any) -> None:
    manager.add_request("p", SO(choice=["xy"]))
    x, y = (tokenizer.convert_tokens_to_ids(t) for t in ("x", "y"))
    plan = _plan(1, [30], [True], new=[(30, "p", 0)])
    manager.mark(plan)
    manager.on_result(plan, StepResult(1, np.array([30]), np.array([x])), [])
    # Preempted (dropped from the workers), then resumed: a NewSeq again, same sample.
    again = _plan(2, [30], [True], new=[(30, "p", 0)])
    manager.mark(again)
    assert set(allowed(manager.bitmask(again)[0])) == {y}
    manager.release("p")
