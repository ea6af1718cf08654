"""StructuredOutputsParams: the constraint's shape is checked where it is made (no xgrammar)."""

from __future__ import annotations

import pytest

from scheduler import SamplingParams, StructuredOutputsParams


@pytest.mark.parametrize("kwargs, match", [
    ({}, "exactly one of json, regex, choice, grammar, json_object, structural_tag; got none"),
    ({"regex": "a", "choice": ["a"]}, r"exactly one of .*got \['regex', 'choice'\]"),
    ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
    ({"json": 3}, "structured_outputs.json must be a JSON schema"),
    ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
    ({"grammar": 5}, "structured_outputs.grammar must be a non-empty string"),
    ({"choice": []}, "structured_outputs.choice must be a non-empty list"),
    ({"choice": ["a", ""]}, "structured_outputs.choice must be a non-empty list"),
    ({"choice": ["a", 1]}, "structured_outputs.choice must be a non-empty list"),
    ({"json_object": True, "disable_any_whitespace": "yes"},
     "structured_outputs.disable_any_whitespace must be true or false"),
])
def test_bad_constraint_shapes_name_the_field(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(**kwargs)


def test_json_text_and_dict_are_one_constraint() -> None:
    a = StructuredOutputsParams(json='{"type": "object", "required": ["b", "a"]}')
    b = StructuredOutputsParams(json={"required": ["b", "a"], "type": "object"})
    assert a.json == b.json and a.key() == b.key() and a.kind == "json"
    assert a.key() != StructuredOutputsParams(json=b.json, disable_any_whitespace=True).key()
    assert a.key() != StructuredOutputsParams(json=b.json, reasoning=True).key()
    assert StructuredOutputsParams(choice=("x", "y")).choice == ["x", "y"]


def test_sampling_params_take_only_a_structured_outputs_params() -> None:
    so = StructuredOutputsParams(regex=r"\d+")
    assert SamplingParams(structured_outputs=so).structured_outputs is so
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": r"\d+"})
