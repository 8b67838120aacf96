"""Reading the JSON and YAML files users give (specs, plans, ds_configs, HF config.json,
calibrated specs): the one place that checks a path before reading it and the text after.

``read_text`` reads a path only when it is a regular file of at most ``MAX_INPUT_BYTES``:
a FIFO (reading it would wait for a writer forever), a device such as ``/dev/zero`` (endless),
a folder, a path longer than the system allows or an unreadable file is refused before any
byte is read, with one ``AmspUserError`` line naming the path, the cause and the limit.

``parse`` turns every way such a file's content can be bad into one ``BadContent`` message
(the callers prefix the file and the fix): a syntax error with its line, ``NaN``/``Infinity``
(JSON allows neither; YAML's ``.nan``/``.inf`` are refused too, as no field takes them), a key
given twice in one mapping (JSON and YAML parsers would silently keep the last), nesting deeper
than any amsp input needs (a 5,000-deep ``[[[...]]]`` would otherwise end in a RecursionError),
and more than ``MAX_VALUES`` values once YAML aliases are expanded (a "billion laughs" alias
bomb is a few hundred bytes that expand to 10^9 values: it is refused in milliseconds instead
of hanging whatever walks it next).
"""

from __future__ import annotations

import errno
import functools
import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from amsp_planner.errors import AmspUserError, shown

MAX_DEPTH = 64
"""Deepest nesting of lists and mappings accepted (amsp files nest a handful deep)."""
MAX_VALUES = 1_000_000
"""Most values (scalars, lists, mappings, aliases expanded) one input may hold; the largest
plan amsp writes holds a few thousand."""
MAX_INPUT_BYTES = 16 * 2**20
"""Largest input file read (16 MiB); plans are about 10 kB, specs and configs a few kB."""


class BadContent(ValueError):
    """The text does not parse, or holds values no amsp input may hold."""


# ----- the path -----------------------------------------------------------------------------
def file_kind(mode: int) -> str:
    """What a path that is not a regular file is, in words."""
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def path_too_long(path: str | Path) -> str | None:
    """Why `path` is longer than the system takes (whole path or one name), else None."""
    text = os.fspath(path)
    limit = os.pathconf("/", "PC_PATH_MAX") if hasattr(os, "pathconf") else 4096
    if len(os.fsencode(text)) >= limit:
        return f"the path is {len(text):,} characters, over the system's limit of {limit - 1:,}"
    name_max = os.pathconf("/", "PC_NAME_MAX") if hasattr(os, "pathconf") else 255
    for part in Path(text).parts:
        if len(os.fsencode(part)) > name_max:
            return (f"a name in it is {len(part):,} characters, over the system's limit of "
                    f"{name_max:,}")
    return None


def _refuse(label: str, why: str, fix: str) -> AmspUserError:
    return AmspUserError(f"{label}: {why}: {fix}")


def read_text(path: str | Path, label: str | None = None, fix: str = "give a file",
              limit: int = MAX_INPUT_BYTES) -> str:
    """The text of `path`, a regular UTF-8 file of at most `limit` bytes; otherwise one
    AmspUserError line '`label`: why: `fix`' (`label` defaults to the path, shown cut when
    long), raised before anything is read from a FIFO, a device or a folder."""
    label = label or shown(os.fspath(path))
    long = path_too_long(path)
    if long:
        raise _refuse(label, long, "give a shorter path")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise _refuse(label, "does not exist", "check the path") from None
    except OSError as e:
        raise _refuse(label, f"cannot read it ({e.strerror})", "check the path") from None
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(label, f"is {file_kind(st.st_mode)}, not a regular file", fix)
    if st.st_size > limit:
        raise _refuse(label, f"is {st.st_size:,} bytes, over the limit of {limit:,} bytes "
                      "for an input file", fix)
    try:
        # O_NONBLOCK: should the path become a FIFO after the stat, opening it does not wait
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise _refuse(label, f"cannot read it ({e.strerror})", "check the path and its "
                      "permissions") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _refuse(label, "is not a regular file", fix)
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise _refuse(label, f"cannot read it ({e.strerror or errno.errorcode.get(e.errno)})",
                      "check the path") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise _refuse(label, f"is over the limit of {limit:,} bytes for an input file", fix)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise _refuse(label, "is not UTF-8 text", fix) from None


# ----- the content --------------------------------------------------------------------------
def _no_constant(name: str):
    raise BadContent(f"'{name}' is not a JSON number: write a finite number")


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise BadContent(f"key '{shown(key)}' is given twice in one object: keep one")
        out[key] = value
    return out


# YAML 1.2's floats: PyYAML (YAML 1.1) reads '1e6' or '4e2' as a string, which a number field
# would refuse; 1.1's own forms ('1.0e+6', '.5', '.inf') stay as PyYAML resolves them
_FLOAT_12 = r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"


@functools.lru_cache(maxsize=1)
def _yaml_loader():
    """A yaml SafeLoader that refuses a key given twice in one mapping (naming it) and nesting
    deeper than MAX_DEPTH, and reads YAML 1.2 exponent floats ('1e6') as numbers."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent, index):
            # refused at MAX_DEPTH, before the recursive composer goes 5,000 frames deep
            self.depth += 1
            try:
                if self.depth > MAX_DEPTH:
                    raise BadContent(f"nested more than {MAX_DEPTH} levels deep: no amsp "
                                     "input is")
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                seen = set()
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":  # '<<': may be overridden
                        continue
                    key = self.construct_object(key_node, deep=True)
                    try:
                        dup = key in seen
                    except TypeError:  # an unhashable key: SafeLoader's own error follows
                        break
                    if dup:
                        line = key_node.start_mark.line + 1
                        raise BadContent(f"key '{shown(str(key))}' is given twice in one "
                                         f"mapping (line {line}): keep one")
                    seen.add(key)
            return super().construct_mapping(node, deep=deep)

    Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(_FLOAT_12),
                                 list("-+0123456789."))
    return Loader


def _children(node: Any) -> list:
    if isinstance(node, dict):
        return [*node.values(), *(k for k in node if isinstance(k, float))]
    return list(node)


def _check(data: Any) -> None:
    """Refuse non-finite floats, nesting deeper than MAX_DEPTH, a list or mapping that holds
    itself, and more than MAX_VALUES values with shared YAML aliases counted each time they
    are used. Iterative, and each shared list or mapping is visited once (its expanded size and
    depth kept by id), so an alias bomb is measured in the time its few nodes take."""
    seen: dict[int, tuple[int, int] | None] = {}  # id -> (values, depth); None: in progress
    stack: list[tuple[Any, bool]] = [(data, False)]
    while stack:
        node, done = stack.pop()
        if isinstance(node, float) and not math.isfinite(node):
            raise BadContent(f"holds the value {node}: write a finite number")
        if not isinstance(node, dict | list | tuple):
            continue
        if not done:
            if id(node) in seen:
                continue
            seen[id(node)] = None
            pairs = node.items() if isinstance(node, dict) else enumerate(node)
            for key, v in pairs:  # name the field where it has one
                if isinstance(v, float) and not math.isfinite(v):
                    where = f"field '{key}'" if isinstance(node, dict) else f"entry [{key}]"
                    raise BadContent(f"{where} holds the value {v}: write a finite number")
            stack.append((node, True))
            stack.extend((c, False) for c in _children(node))
            continue
        count, depth = 1, 0
        for c in _children(node):
            if isinstance(c, dict | list | tuple):
                sub = seen.get(id(c))
                if sub is None:
                    raise BadContent("a list or mapping holds itself (a YAML alias inside its "
                                     "own anchor): no amsp input does")
                count, depth = count + sub[0], max(depth, sub[1])
            else:
                count += 1
        if depth + 1 > MAX_DEPTH:
            raise BadContent(f"nested more than {MAX_DEPTH} levels deep: no amsp input is")
        if count > MAX_VALUES:
            raise BadContent(f"holds more than {MAX_VALUES:,} values (YAML aliases expanded): "
                             "no amsp input is that large")
        seen[id(node)] = (count, depth + 1)


def parse(text: str, kind: str) -> Any:
    """The data of a 'json' or 'yaml' text; BadContent (a short reason) when it is bad."""
    import yaml

    try:
        data = (json.loads(text, parse_constant=_no_constant, object_pairs_hook=_unique_pairs)
                if kind == "json" else yaml.load(text, Loader=_yaml_loader()))  # noqa: S506
    except BadContent:
        raise
    except RecursionError:
        raise BadContent(f"nested more than {MAX_DEPTH} levels deep: no amsp input is") from None
    except json.JSONDecodeError as e:
        raise BadContent(f"malformed JSON at line {e.lineno}, column {e.colno} ({e.msg})") \
            from None
    except ValueError as e:
        if "digits" in str(e):  # an integer past Python's int-from-text limit
            raise BadContent("holds an integer of more than 4,300 digits: no amsp input "
                             "does") from None
        if kind == "json":
            raise BadContent(f"malformed JSON ({e})") from None
        raise BadContent("malformed YAML") from None
    except yaml.constructor.ConstructorError as e:  # a tag such as !!python/object
        mark = getattr(e, "problem_mark", None)
        line = f" at line {mark.line + 1}" if mark is not None else ""
        raise BadContent(f"unsupported YAML tag{line} ({e.problem}): write plain values"
                         ) from None
    except (yaml.YAMLError, TypeError) as e:  # TypeError etc.: '!!int x'
        mark = getattr(e, "problem_mark", None)
        line = f" at line {mark.line + 1}" if mark is not None else ""
        raise BadContent(f"malformed YAML{line}") from None
    _check(data)
    return data


def load(path: str | Path, kind: str | None = None, label: str | None = None,
         fix: str = "give a file") -> Any:
    """The parsed data of a JSON or YAML file (`kind`: by default from the suffix, .json being
    JSON and anything else YAML); one AmspUserError line naming the file otherwise."""
    kind = kind or ("json" if Path(path).suffix == ".json" else "yaml")
    text = read_text(path, label, fix)
    try:
        return parse(text, kind)
    except BadContent as e:
        raise AmspUserError(f"{label or shown(os.fspath(path))}: {e}: fix the file") from None
