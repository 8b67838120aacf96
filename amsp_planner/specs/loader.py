"""Loading specs: presets by name, YAML/JSON files, Hugging Face config.json.

Every error becomes an ``AmspUserError`` with one line naming the file, the field and the fix.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from amsp_planner.errors import AmspUserError, format_validation_error, readable, shown
from amsp_planner.specs.cluster import ClusterSpec, resolve_gpu
from amsp_planner.specs.fields import suggest  # noqa: F401 - also this module's API
from amsp_planner.specs.hf import model_data
from amsp_planner.specs.model import ModelSpec
from amsp_planner.textfile import load, path_too_long

PRESETS = Path(__file__).resolve().parent.parent / "presets"
DEFAULT_CLUSTER = "dgx-a100-hdr"

def list_presets(kind: str) -> list[str]:
    """Preset names of 'model' or 'cluster' specs."""
    folder = PRESETS / f"{kind}_specs"
    return sorted(p.stem for p in folder.glob("*.yaml"))


def _read_mapping(path: Path) -> dict[str, Any]:
    data = load(path, fix="give a YAML or JSON spec file")
    if not isinstance(data, dict):
        raise AmspUserError(f"{path}: expected a mapping of fields at the top level, got "
                            f"{type(data).__name__}: write 'field: value' lines")
    return data


_MARKS = {"model": ("hidden_size", "num_layers", "num_heads", "vocab_size"),
          "cluster": ("gpus_per_node", "intra_fabric", "nic_gbit_per_s")}
"""Fields only one kind of spec has: a file of the other kind is named as such."""


def _check_kind(data: dict[str, Any], kind: str, path: Path) -> None:
    """Refuse a plan file, or the other kind of spec, given as `kind` (one line saying what the
    file is, not a run of every field pydantic finds missing)."""
    if data.get("format") == "amsp-plan":
        raise AmspUserError(f"--{kind} {path}: is a plan file, not a {kind} spec: give it to "
                            "amsp explain, export or train, or give a spec here")
    other = "cluster" if kind == "model" else "model"
    if any(k in data for k in _MARKS[other]) and not any(k in data for k in _MARKS[kind]):
        raise AmspUserError(f"--{kind} {path}: is a {other} spec, not a {kind} spec: give it "
                            f"as --{other}")


def _validate(cls: type[BaseModel], data: dict[str, Any], source: str):
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise AmspUserError(format_validation_error(e, source, cls)) from None


ALIASES = {
    "model": {"llama-70b": "llama2-70b", "llama-33b": "llama-30b", "llama3.1-405b": "llama3-405b",
              "gpt3": "gpt3-175b"},
    "cluster": {"dgx-a100": "dgx-a100-hdr", "dgx-h100": "dgx-h100-ndr",
                "dgx-h200": "dgx-h200-ndr", "p4d": "aws-p4d"},
}
"""Other names users write for presets (docs and papers say llama-70b). None is taken
silently: each is refused with its preset as the suggestion, as any near miss is."""


def _unknown(name: str, kind: str) -> AmspUserError:
    names = list_presets(kind)
    close = suggest(name, names, ALIASES[kind])
    hint = f"did you mean {close}? " if close else ""
    return AmspUserError(f"--{kind}: unknown {kind} '{shown(name)}': {hint}use one of "
                         f"{', '.join(names)}, or a path to a spec file")


def _resolve(name: str, kind: str) -> Path:
    if not name.strip():
        raise AmspUserError(f"--{kind} is empty: give a preset name (amsp specs list) or a "
                            "spec file")
    path = Path(name)
    long = path_too_long(path)
    if long:
        raise AmspUserError(f"--{kind} {shown(name)}: {long}: give a shorter path")
    if path.is_dir():
        if kind == "model" and (path / "config.json").is_file():
            return path / "config.json"
        raise AmspUserError(
            f"--{kind}: {name} is a folder" + (" without a config.json: give a spec file or a "
                                               "Hugging Face model folder" if kind == "model"
                                               else ": give a cluster spec file"))
    if path.suffix in (".yaml", ".yml", ".json") or path.exists():
        if not path.exists():
            raise AmspUserError(f"--{kind}: file {name} does not exist: check the path")
        return path
    preset = PRESETS / f"{kind}_specs" / f"{name}.yaml"
    if "/" in name or not preset.exists():
        raise _unknown(name, kind)
    return preset


@lru_cache(maxsize=64)
def load_model(name: str) -> ModelSpec:
    """A ModelSpec from a preset name, a YAML/JSON spec file, or a Hugging Face config.json."""
    path = _resolve(name, "model")
    data = _read_mapping(path)
    if is_hf_config(data):
        return model_from_hf_config(data, str(path))
    _check_kind(data, "model", path)
    data.setdefault("name", path.stem)
    return _validate(ModelSpec, data, str(path))


def model_from_hf_config(cfg: dict[str, Any], source: str = "config.json") -> ModelSpec:
    """Translate a Hugging Face config.json of a dense decoder into a ModelSpec."""
    return _validate(ModelSpec, model_data(cfg, source), source)


def is_hf_config(data: dict[str, Any]) -> bool:
    return "model_type" in data or "architectures" in data


_WORDS = {"true": True, "false": False, "null": None}


def parse_value(text: str) -> Any:
    """A --set value: an integer, a number (``1e3``, ``0.5``; ``nan`` and ``inf`` too, for the
    spec's own check to refuse by name), ``true``/``false``/``null``, else the text itself (a
    GPU name, a fabric). YAML's other spellings (``yes``, ``on``, ``0x10``) stay text, so a
    field of another type refuses them instead of taking them as 1."""
    t = text.strip()
    if t.lower() in _WORDS:
        return _WORDS[t.lower()]
    if not t.isascii() or "_" in t:  # int() and float() take any script's digits and 4_00
        return t  # a text: a numeric field refuses it by name
    for conv in (int, float):
        try:
            return conv(t)
        except ValueError:
            pass
    return t


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A cluster spec's mapping with ``--set`` overrides applied (dotted keys for nested
    fields, e.g. ``{"gpu.memory_gib": 40}``); `data` itself is left unchanged."""
    data = dict(data)
    # whole groups first (gpu=NAME), then the fields inside them (gpu.memory_gib=40)
    for key, value in sorted(overrides.items(), key=lambda kv: kv[0].count(".")):
        if key == "gpu" and isinstance(value, str):
            try:
                value = resolve_gpu({"gpu": value})["gpu"]
            except ValueError as e:
                raise AmspUserError(f"--set gpu={shown(value)}: {e}") from None
        target = data
        parts = key.split(".")
        for part in parts[:-1]:
            if not isinstance(target.get(part), dict):
                raise AmspUserError(f"--set {shown(key)}: '{shown(part)}' is not a group of "
                                    "fields: use gpu.FIELD")
            child = dict(target[part])
            target[part] = child
            target = child
        top_fields = ClusterSpec.model_fields if len(parts) == 1 else None
        if top_fields is not None and parts[0] not in top_fields:
            close = ", ".join(sorted(k for k in top_fields if k != "measured"))
            near = suggest(parts[0], list(top_fields))
            hint = f"did you mean {near}? " if near else ""
            raise AmspUserError(f"--set {shown(key)}: no such cluster field: {hint}use one of "
                                f"{close}")
        target[parts[-1]] = value
    return data


def load_cluster(name: str | None = None, overrides: dict[str, Any] | None = None) -> ClusterSpec:
    """A ClusterSpec from a preset name or spec file, with optional field overrides.

    Overrides use dotted keys for nested fields, e.g. ``{"gpu.memory_gib": 40}``.
    """
    path = _resolve(DEFAULT_CLUSTER if name is None else name, "cluster")
    data = _read_mapping(path)
    _check_kind(data, "cluster", path)
    data.setdefault("name", path.stem)
    try:
        data = resolve_gpu(data)
    except ValueError as e:
        raise AmspUserError(f"{path}: field 'gpu': {e}") from None
    if overrides:
        data = apply_overrides(data, overrides)
        data["name"] = f"{data['name']}*"
    try:
        return ClusterSpec.model_validate(data)
    except ValidationError as e:
        raise AmspUserError(_cluster_error(e, path, overrides or {})) from None


def _cluster_error(e: ValidationError, path: Path, overrides: dict[str, Any]) -> str:
    """One line naming the ``--set KEY=VALUE`` at fault when an override is, else the file."""
    for err in e.errors():
        key = ".".join(str(p) for p in err.get("loc", ()))
        if key in overrides:
            value = overrides[key]
            text = json.dumps(value) if isinstance(value, bool) or value is None else value
            if err.get("type") == "extra_forbidden":
                from amsp_planner.errors import field_meant

                close, names = field_meant(ClusterSpec, tuple(err["loc"]))
                hint = f"did you mean {key.rsplit('.', 1)[0]}.{close}?" if close else \
                    f"use one of {', '.join(names)}"
                return readable(f"--set {key}={shown(text)}: no such field: {hint}")
            msg = err.get("msg", "invalid value").removeprefix("Value error, ")
            return readable(f"--set {key}={shown(text)}: {msg}: give a value the field takes")
    return format_validation_error(e, str(path) if not overrides else f"{path} with --set",
                                   ClusterSpec)


_SUFFIX = {"K": 2**10, "M": 2**20, "G": 2**30}


def parse_batch(text: str, field: str = "--global-batch") -> int:
    """'4M' -> 4*2**20, '512K' -> 512*2**10, '16384' -> 16384."""
    t = str(text).strip()
    mult = 1
    if t and t[-1].upper() in _SUFFIX:
        mult = _SUFFIX[t[-1].upper()]
        t = t[:-1]
    try:
        value = int(t) * mult
    except ValueError:
        raise AmspUserError(
            f"{field}: '{shown(text)}' is not a count: write an integer with an optional K/M/G suffix "
            "(powers of 2), e.g. 4M"
        ) from None
    if value < 1:
        raise AmspUserError(f"{field}: must be at least 1, got {text}")
    return value


def split_set(item: str, form: str = "VALUE", example: str = "400") -> tuple[str, str]:
    """(key, value text) of one --set KEY=VALUE item; one line naming the item otherwise
    (`form`, `example`: how the command writes its values, e.g. VALUE[,VALUE...])."""
    key, eq, value = item.partition("=")
    if eq and key.strip() and not value.strip():
        raise AmspUserError(f"--set {key.strip()}: the value is empty: write {key.strip()}={form}")
    if not eq or not key.strip():
        raise AmspUserError(f"--set '{item}': write KEY={form}, e.g. --set nic_gbit_per_s={example}")
    return key.strip(), value.strip()


def parse_sets(sets: tuple[str, ...]) -> dict:
    """--set KEY=VALUE items as a dict of parsed values; one line naming the item otherwise."""
    out = {}
    for item in sets:
        key, value = split_set(item)
        if key in out:  # the last one won silently
            raise AmspUserError(f"--set {key}: given twice: give each field once")
        out[key] = parse_value(value)
    return out
