"""Tables of evaluations (compare, plan)."""

from __future__ import annotations

from amsp_planner.cost.evaluate import Evaluation
from amsp_planner.report.fmt import bytes_h, gib, secs


def compare_table(rows: list[tuple[str, Evaluation]], title: str):
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for col, just in (("name", "left"), ("strategy", "left"), ("mem/GPU GiB", "right"),
                      ("fits", "center"), ("inter-node/GPU", "right"), ("intra-node/GPU", "right"),
                      ("compute", "right"), ("optimizer", "right"), ("exposed comm", "right"), ("step", "right"),
                      ("tokens/s", "right"), ("MFU", "right")):
        t.add_column(col, justify=just)
    for name, e in rows:
        t.add_row(
            name, str(e.strategy), gib(e.memory.total), "yes" if e.fits else "NO",
            bytes_h(e.bytes_per_rank("inter")), bytes_h(e.bytes_per_rank("intra")),
            secs(e.time.compute_s), secs(e.time.optimizer_s), secs(e.time.exposed_comm_s),
            secs(e.step_s),
            f"{e.tokens_per_s:,.0f}", f"{e.mfu * 100:.1f}%",
        )
    return t


def schedule_table(e: Evaluation):
    from rich.table import Table

    t = Table(title="collective schedule (per step, per GPU)", title_justify="left")
    for col in ("phase", "op", "group", "size", "stride", "per node", "dtype", "calls",
                "full bytes", "intra/GPU", "inter/GPU", "time"):
        t.add_column(col, justify="left" if col in ("phase", "op", "group", "dtype") else "right")
    for s in e.schedule:
        t.add_row(s.phase, s.op, s.group, str(s.group_size), str(s.stride),
                  str(s.members_per_node), s.dtype, f"{s.calls_per_step:,}",
                  bytes_h(s.full_bytes_per_step), bytes_h(s.intra_bytes_per_rank_per_step),
                  bytes_h(s.inter_bytes_per_rank_per_step), secs(s.time_s))
    return t


def memory_table(e: Evaluation):
    from rich.table import Table

    t = Table(title="memory per GPU", title_justify="left")
    t.add_column("term")
    t.add_column("GiB", justify="right")
    m = e.memory
    for name in ("params", "grads", "optimizer", "hpz", "gather_buffers", "grad_buffers",
                 "staging", "step_buffer", "activations", "loss_peak", "fragmentation",
                 "communicators", "context"):
        v = getattr(m, name)
        if v:
            t.add_row(name, gib(v))
    t.add_row("total", gib(m.total))
    t.add_row("limit", gib(e.memory_limit))
    return t
