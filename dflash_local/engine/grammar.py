"""Constrained decoding: JSON schemas become GBNF grammars with llama-cpp-python's port of llama.cpp's converter; the
grammar itself runs in llama.cpp (the native Sampler).

llama.cpp's grammar parser recurses once per level of nesting, and a grammar nested deep enough (20,000 parentheses,
or a schema's maxLength of 20,000, which the converter writes as that many nested groups) overflows the stack: the
process dies, it gets no error. So what a request carries is bounded before it is converted (check_schema) and before
it reaches the parser (check_grammar), and grammar_guard.py loads each new grammar in a child process first.
"""

from __future__ import annotations

import json
import re

# llama-cpp-python's port lets a string hold raw control characters, which JSON forbids; llama.cpp's converter does not
_CHAR_RULE = r'char ::= [^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4})'

# The limits (docs/server.md). A schema's counts become nested groups in the converter's output, and llama.cpp's
# parser refuses more than 1,000 of those (its MAX_REPETITION_THRESHOLD on the rules a repetition adds); a group
# nested in another costs its parser a few hundred bytes of stack
MAX_SCHEMA_BYTES = 256 * 1024
MAX_SCHEMA_DEPTH = 64
MAX_REPETITION = 1000
MAX_GRAMMAR_BYTES = 1024 * 1024
MAX_NESTING = MAX_REPETITION + 64  # a schema's counts, and the levels around them
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "minContains",
           "maxContains")


class GrammarLimitError(ValueError):
    """A schema or grammar over one of the limits above."""


def check_schema(schema) -> None:
    """Refuse a JSON schema over the size, depth or repetition limits, before it is converted."""
    size = len(json.dumps(schema))
    if size > MAX_SCHEMA_BYTES:
        raise GrammarLimitError(f"the JSON schema has {size} bytes, over the limit of {MAX_SCHEMA_BYTES}")
    todo = [(schema, 1)]
    while todo:
        node, depth = todo.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarLimitError(f"the JSON schema is nested deeper than the limit of {MAX_SCHEMA_DEPTH} levels")
        if isinstance(node, dict):
            for key, value in node.items():
                if key in _COUNTS and isinstance(value, (int, float)) and not isinstance(value, bool) \
                        and value > MAX_REPETITION:
                    raise GrammarLimitError(f"the JSON schema's {key} of {value} is over the limit of {MAX_REPETITION} "
                                            "repetitions")
                todo.append((value, depth + 1))
        elif isinstance(node, list):
            todo.extend((value, depth + 1) for value in node)


def check_grammar(text: str) -> None:
    """Refuse a GBNF grammar over the size or nesting limits, reading it as llama.cpp's parser does (strings, character
    classes and comments hold no nesting)."""
    size = len(text.encode("utf-8"))
    if size > MAX_GRAMMAR_BYTES:
        raise GrammarLimitError(f"the grammar has {size} bytes, over the limit of {MAX_GRAMMAR_BYTES}")
    depth, i, n = 0, 0, len(text)
    while i < n:
        c = text[i]
        if c == "#":  # a comment, to the end of the line
            while i < n and text[i] not in "\r\n":
                i += 1
            continue
        if c in "\"[":  # a literal or a character class: to its closing quote or bracket, escapes skipped
            end = '"' if c == '"' else "]"
            i += 1
            while i < n and text[i] != end:
                i += 2 if text[i] == "\\" else 1
        elif c == "(":
            depth += 1
            if depth > MAX_NESTING:
                raise GrammarLimitError(f"the grammar nests groups deeper than the limit of {MAX_NESTING} levels")
        elif c == ")":
            depth -= 1
        i += 1


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
    check_schema(schema)
    schema = schema or {"type": "object"}
    try:
        gbnf = json_schema_to_gbnf(json.dumps(schema))
    except Exception as e:  # the converter raises whatever it meets: unsupported or broken schemas
        raise ValueError(f"the JSON schema cannot be turned into a grammar: {e}") from None
    return re.sub(r"^char ::= .*$", lambda _: _CHAR_RULE, gbnf, count=1, flags=re.M)


def grammar_of(grammar: str | None, json_schema: dict | str | None) -> str | None:
    """The GBNF grammar a request asks for: a grammar, or a JSON schema's; not both. Either is checked against the
    limits (GrammarLimitError)."""
    if grammar is not None and json_schema is not None:
        raise ValueError("give either a grammar or a JSON schema, not both")
    text = json_schema_grammar(json_schema) if json_schema is not None else grammar
    if text is not None:
        if not isinstance(text, str):
            raise ValueError("grammar must be a string (GBNF)")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("the grammar is not valid Unicode (it holds a lone surrogate)") from None
        check_grammar(text)
    return text
