"""Constraints as xgrammar grammars: what a `StructuredOutputsParams` means, and which JSON
Schemas can be enforced at all.

`build_grammar(spec)` turns a constraint (JSON Schema, JSON object, regex, choice, EBNF/Lark
grammar, structural tag; optionally behind Qwen3's reasoning block) into an uncompiled
xgrammar Grammar; compiling and caching it, and matching tokens against it, are the
structured-output manager's (structured_output.py). `check_schema` refuses a JSON Schema that
uses a keyword xgrammar would accept without enforcing it. Every failure is a `ValueError`
naming the problem, with xgrammar's source locations taken out (no paths reach a client).
xgrammar is imported lazily, inside the functions.
"""

from __future__ import annotations

import json
import re
from typing import Any

from cluster.engine.reasoning import THINK_BEGIN, THINK_END
from scheduler.sampling_params import StructuredOutputsParams

# Consecutive whitespace characters allowed between JSON tokens: pretty-printed JSON nested 15
# deep fits, and a model cannot loop on whitespace forever (xgrammar's own advice).
MAX_JSON_WHITESPACE = 32

# JSON Schema keywords xgrammar 0.2 accepts without enforcing them (checked by
# tests/cluster/engine/test_structured_output.py): a schema using one is refused, not half-honoured.
_UNENFORCED_KEYWORDS = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas",
                        "dependencies", "unevaluatedItems")
# Keywords whose value maps names to subschemas, and keywords whose value is data.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_VALUES = ("enum", "const", "default", "examples", "required")
_XGRAMMAR_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def build_grammar(spec: StructuredOutputsParams) -> Any:
    """`spec` as an (uncompiled) xgrammar Grammar; ValueError for one that cannot be built."""
    import xgrammar as xgr

    kind = spec.kind
    try:
        if kind in ("json", "json_object"):
            schema = spec.json if kind == "json" else {"type": "object"}
            check_schema(schema)
            if spec.disable_any_whitespace:
                grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False,
                                                       separators=(",", ":"))
            else:
                grammar = xgr.Grammar.from_json_schema(json.dumps(schema),
                                                       max_whitespace_cnt=MAX_JSON_WHITESPACE)
        elif kind == "regex":
            grammar = xgr.Grammar.from_regex(spec.regex)
        elif kind == "choice":
            # JSON string literals are EBNF string literals (quotes and backslashes escaped).
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
            grammar = xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
        elif kind == "grammar":
            grammar = (xgr.Grammar.from_ebnf(spec.grammar) if "::=" in spec.grammar
                       else xgr.Grammar.from_lark(spec.grammar))
        else:
            grammar = xgr.Grammar.from_structural_tag(spec.structural_tag)
    except ValueError as e:
        raise ValueError(f"the {kind} constraint is invalid: {xgrammar_message(e)}") from None
    except Exception as e:  # noqa: BLE001 — xgrammar reports a bad constraint as RuntimeError
        raise ValueError(f"the {kind} constraint does not compile: "
                         f"{xgrammar_message(e)}") from None
    if spec.reasoning:
        grammar = xgr.Grammar.concat(_reasoning_prefix(), grammar)
    return grammar


def _reasoning_prefix() -> Any:
    """An optional complete `<think>...</think>\\n\\n` block (what Qwen3 opens with)."""
    import xgrammar as xgr
    from xgrammar.structural_tag import (
        AnyTextFormat,
        ConstStringFormat,
        OptionalFormat,
        SequenceFormat,
        StructuralTag,
        TagFormat,
    )

    block = SequenceFormat(elements=[
        TagFormat(begin=THINK_BEGIN, content=AnyTextFormat(excludes=[THINK_BEGIN, THINK_END]),
                  end=THINK_END),
        ConstStringFormat(value="\n\n")])
    return xgr.Grammar.from_structural_tag(
        StructuralTag(format=OptionalFormat(content=block)).model_dump_json())


def check_schema(schema: Any, path: str = "$") -> None:
    """ValueError for a JSON Schema keyword xgrammar would accept but not enforce."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            check_schema(item, f"{path}[{i}]")
        return
    if not isinstance(schema, dict):
        return
    for keyword in _UNENFORCED_KEYWORDS:
        if keyword in schema:
            _unenforced(keyword, path)
    if schema.get("uniqueItems") is True:
        _unenforced("uniqueItems", path)
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        _unenforced("allOf with more than one schema", path)
    multiple = schema.get("multipleOf")
    if multiple is not None and not (isinstance(multiple, int) and schema.get("type") == "integer"):
        _unenforced("multipleOf (other than an integer's integer multipleOf)", path)
    if (("pattern" in schema or "format" in schema)
            and ("minLength" in schema or "maxLength" in schema)):
        _unenforced("minLength/maxLength together with pattern or format", path)
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():  # names -> schemas: the names are not keywords
                check_schema(sub, f"{path}.{key}.{name}")
        elif key not in _VALUES and isinstance(value, (dict, list)):
            check_schema(value, f"{path}.{key}")


def _unenforced(what: str, path: str) -> None:
    raise ValueError(f"the JSON schema uses {what} at {path}, which structured outputs cannot "
                     "enforce; remove it or express it another way")


def xgrammar_message(e: BaseException) -> str:
    """xgrammar's error text without its source location (no paths reach a client)."""
    lines = [_XGRAMMAR_LOCATION.sub("", line).strip() for line in str(e).splitlines()]
    return next((line for line in lines if line), type(e).__name__)
