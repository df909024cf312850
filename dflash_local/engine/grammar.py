"""Constrained decoding: JSON schemas become GBNF grammars with llama-cpp-python's port of llama.cpp's converter; the
grammar itself runs in llama.cpp (the native Sampler)."""

from __future__ import annotations

import json
import re

# llama-cpp-python's port lets a string hold raw control characters, which JSON forbids; llama.cpp's converter does not
_CHAR_RULE = r'char ::= [^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4})'


def json_schema_grammar(schema: dict | str) -> str:
    """The GBNF grammar of a JSON schema (an empty schema means any JSON object, as llama-server reads it)."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError("a JSON schema must be a JSON object")
    schema = schema or {"type": "object"}
    try:
        gbnf = json_schema_to_gbnf(json.dumps(schema))
    except Exception as e:  # the converter raises whatever it meets: unsupported or broken schemas
        raise ValueError(f"the JSON schema cannot be turned into a grammar: {e}") from None
    return re.sub(r"^char ::= .*$", lambda _: _CHAR_RULE, gbnf, count=1, flags=re.M)


def grammar_of(grammar: str | None, json_schema: dict | str | None) -> str | None:
    """The GBNF grammar a request asks for: a grammar, or a JSON schema's; not both."""
    if grammar is not None and json_schema is not None:
        raise ValueError("give either a grammar or a JSON schema, not both")
    return json_schema_grammar(json_schema) if json_schema is not None else grammar
