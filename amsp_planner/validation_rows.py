"""The published rows' files: where they are, and the checks every row passes when read.

``presets/validation.yaml`` holds the dense runs, ``presets/validation_moe.yaml`` the
mixture-of-experts runs (the same schema plus the MoE fields in its header); both are read with
``load_rows`` and checked by ``check_rows`` (amsp_planner/validation.py prices them).
"""

from __future__ import annotations

from pathlib import Path

PRESETS = Path(__file__).resolve().parent / "presets"
ROWS_FILE = PRESETS / "validation.yaml"
MOE_ROWS_FILE = PRESETS / "validation_moe.yaml"
"""Published mixture-of-experts runs: the same schema plus the MoE fields in its header, with
their own statistics (bench/gpu_validation.py); the planner's bands come from ROWS_FILE only."""

REQUIRED = ("id", "source", "engine", "gpus", "metric", "value", "scope")


def check_rows(doc: dict) -> dict:
    """`doc` when every row has the fields a row needs, a known source and a scope; else
    ValueError naming the row and the field."""
    for i, row in enumerate(doc["rows"]):
        name = row.get("id", f"#{i + 1}")
        for field in REQUIRED:
            if row.get(field) in (None, ""):
                raise ValueError(f"validation.yaml: row {name}: field '{field}' is missing: "
                                 "give it (scope: in, or the reason the row is out of scope)")
        if row["source"] not in doc["sources"]:
            raise ValueError(f"validation.yaml: row {name}: field 'source': "
                             f"'{row['source']}' is not a key of sources: add it there")
        if "engine_version" in row and not isinstance(row["engine_version"], str):
            raise ValueError(f"validation.yaml: row {name}: field 'engine_version' must be a "
                             "quoted release, e.g. '0.3.14'")
        _check_execution(name, row.get("execution"))
        if row["scope"] == "in" and not (row.get("strategy") and row.get("cluster")):
            raise ValueError(f"validation.yaml: row {name}: a row in scope needs fields "
                             "'strategy' and 'cluster'")
    _check_bf16_rows(doc["rows"])
    return doc


def _check_execution(name: str, settings: object) -> None:
    """A row's `execution:` names fields of the engine profile's ``Execution`` with numbers
    (ValueError naming the row and the field otherwise)."""
    if settings is None:
        return
    import dataclasses

    from amsp_planner.engine_execution import Execution

    fields = {f.name for f in dataclasses.fields(Execution)} - {"sources"}
    if not isinstance(settings, dict) or not settings:
        raise ValueError(f"validation.yaml: row {name}: field 'execution' must map Execution "
                         "fields to the run's values, e.g. {max_live_params: 3000000000}")
    for k, v in settings.items():
        if k not in fields:
            raise ValueError(f"validation.yaml: row {name}: field 'execution': '{k}' is not an "
                             f"Execution field (amsp_planner/engine_execution.py): use one of "
                             f"{', '.join(sorted(fields))}")
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError(f"validation.yaml: row {name}: field 'execution': '{k}' must be "
                             f"a number, got {v!r}")


def _check_bf16_rows(rows: list[dict]) -> None:
    """Each `bf16_row` names a bf16 row of the same source, model, GPUs and batch, given on
    an FP8 row (ValueError naming the row and the field otherwise)."""
    by_id = {r.get("id"): r for r in rows}
    for row in rows:
        ref = row.get("bf16_row")
        if ref is None:
            continue
        other = by_id.get(ref)
        if row.get("training", {}).get("precision") != "fp8":
            raise ValueError(f"validation.yaml: row {row['id']}: field 'bf16_row' is for an "
                             "FP8 row (training: {precision: fp8})")
        if other is None or other.get("training", {}).get("precision", "bf16") != "bf16":
            raise ValueError(f"validation.yaml: row {row['id']}: field 'bf16_row': '{ref}' is "
                             "not a bf16 row of this file")
        for f in ("source", "model", "gpus", "seq_len", "global_batch_seqs", "metric"):
            if other.get(f) != row.get(f):
                raise ValueError(f"validation.yaml: row {row['id']}: field 'bf16_row': {ref} "
                                 f"differs in '{f}'")


def load_rows(path: Path | None = None) -> dict:
    """The rows, read as every YAML input is (``textfile.load``: a key given twice in one row
    is refused, not silently the last one); `path` MOE_ROWS_FILE for the MoE runs (default
    ROWS_FILE)."""
    from amsp_planner.textfile import load

    return check_rows(load(path or ROWS_FILE))
