"""The verdict of a run: did every schedule entry's calls and bytes equal the plan's?

    verdict: all 9 schedule entries match the plan (calls and bytes per step)

One line at the end of ``amsp train``. A difference names the entries that differ and makes the
job exit 5 (``faults.EXIT_DIFFERS``), unless it is a substitution the user asked for: with
``AMSP_GLOO_RS_AS_ALL_REDUCE=1`` every reduce-scatter runs as an all-reduce of the same tensor,
so a planned reduce-scatter measured as an all-reduce of the same calls and full bytes is
named as that substitution and the exit code stays 0.
"""

from __future__ import annotations

import os

from amsp_planner.runtime.collectives import RS_AS_ALL_REDUCE_ENV

FIELDS = ("calls_per_step", "full_bytes_per_step")


def _key(e: dict) -> str:
    return f"{e['phase']}/{e['op']}/{e['group']}"


def _num(e: dict | None) -> tuple:
    return (None, None) if e is None else tuple(e[f] for f in FIELDS)


def _describe(e: dict) -> str:
    p, m = _num(e["planned"]), _num(e["measured"])
    say = {(None, None): "none"}
    plan = say.get(p) or f"{p[0]} calls, {p[1]:,} B"
    meas = say.get(m) or f"{m[0]} calls, {m[1]:,} B"
    return f"{_key(e)} planned {plan}, measured {meas}"


def substitutions(differ: list[dict]) -> list[str] | None:
    """The asked-for reduce-scatter -> all-reduce substitutions explaining every difference,
    or None when some difference is not one of them."""
    if os.environ.get(RS_AS_ALL_REDUCE_ENV) != "1":
        return None
    planned = {(e["phase"], e["group"]): e for e in differ
               if e["op"] == "reduce_scatter" and e["measured"] is None}
    measured = {(e["phase"], e["group"]): e for e in differ
                if e["op"] == "all_reduce" and e["planned"] is None}
    if set(planned) != set(measured) or 2 * len(planned) != len(differ):
        return None
    for k, rs in planned.items():
        if _num(rs["planned"]) != _num(measured[k]["measured"]):
            return None
    return [f"{ph}/reduce_scatter/{g} as all_reduce" for ph, g in sorted(planned)]


def verdict(entries: list[dict]) -> tuple[bool, str]:
    """(whether the run agrees with the plan, the verdict line) from the run report's
    ``schedule`` entries."""
    differ = [e for e in entries if _num(e["planned"]) != _num(e["measured"])]
    n = len(entries)
    if not differ:
        return True, f"verdict: all {n} schedule entries match the plan (calls and bytes per step)"
    subs = substitutions(differ)
    if subs is not None:
        return True, (f"verdict: the schedule matches the plan except the substitution asked for "
                      f"with {RS_AS_ALL_REDUCE_ENV}=1: {'; '.join(subs)}")
    return False, (f"verdict: {len(differ)} of {n} schedule entries differ from the plan: "
                   + "; ".join(_describe(e) for e in differ))
