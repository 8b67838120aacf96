"""Parsing the JSON and YAML files users give (specs, plans, ds_configs, calibrated specs).

``parse`` turns every way such a file's content can be bad into one ``ValueError`` message
(the callers prefix the file and the fix): a syntax error with its line, ``NaN``/``Infinity``
(JSON allows neither; YAML's ``.nan``/``.inf`` are refused too, as no field takes them), and
nesting deeper than any amsp input needs (a 5,000-deep ``[[[...]]]`` would otherwise end in a
RecursionError).
"""

from __future__ import annotations

import json
import math
from typing import Any

MAX_DEPTH = 64
"""Deepest nesting of lists and mappings accepted (amsp files nest a handful deep)."""


class BadContent(ValueError):
    """The text does not parse, or holds values no amsp input may hold."""


def _no_constant(name: str):
    raise BadContent(f"'{name}' is not a JSON number: write a finite number")


def _check(data: Any) -> None:
    """Refuse non-finite floats and nesting deeper than MAX_DEPTH (iteratively)."""
    stack = [(data, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise BadContent(f"nested more than {MAX_DEPTH} levels deep: no amsp input is")
        if isinstance(node, float) and not math.isfinite(node):
            raise BadContent(f"holds the value {node}: write a finite number")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
            stack.extend((k, depth + 1) for k in node if isinstance(k, float))
        elif isinstance(node, list | tuple):
            stack.extend((v, depth + 1) for v in node)


def parse(text: str, kind: str) -> Any:
    """The data of a 'json' or 'yaml' text; BadContent (a short reason) when it is bad."""
    import yaml

    try:
        data = (json.loads(text, parse_constant=_no_constant) if kind == "json"
                else yaml.safe_load(text))
    except BadContent:
        raise
    except RecursionError:
        raise BadContent(f"nested more than {MAX_DEPTH} levels deep: no amsp input is") from None
    except json.JSONDecodeError as e:
        raise BadContent(f"malformed JSON at line {e.lineno}, column {e.colno} ({e.msg})") \
            from None
    except (yaml.YAMLError, ValueError, TypeError) as e:  # TypeError etc.: '!!int x'
        mark = getattr(e, "problem_mark", None)
        line = f" at line {mark.line + 1}" if mark is not None else ""
        raise BadContent(f"malformed YAML{line}") from None
    _check(data)
    return data
