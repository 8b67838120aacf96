"""The text of `amsp plan` and `amsp explain`."""

from __future__ import annotations

from amsp_planner.cost.evaluate import Evaluation
from amsp_planner.report.fmt import gib, secs
from amsp_planner.report.grid import Col, Grid

_NAMES = {"p": "parameters (P)", "g": "gradients (G)", "os": "optimizer states (OS)"}


def components_grid(e: Evaluation, gpus_per_node: int) -> Grid:
    cols = [Col(t, t.split()[0], right=False) for t in
            ("component", "shard factor", "mesh (GPUs/node x nodes)", "scope")]
    g = Grid(f"strategy {e.strategy}", cols)
    for c in ("p", "g", "os"):
        s0, s1 = e.strategy.mesh(c, gpus_per_node)
        f = e.strategy.factor(c)
        scope = "replicated" if f == 1 else ("intra-node" if s1 == 1 else "inter-node")
        g.rows.append([_NAMES[c], str(f), f"{s0} x {s1}", scope])
    s = e.strategy
    extras = []
    if s.qwz:
        extras.append(f"qwZ INT8 weights (block {s.quant_block})")
    if s.hpz > 1:
        extras.append(f"hpZ secondary copy over {s.hpz} GPUs")
    if s.qgz:
        extras.append("qgZ INT4 two-hop gradients")
    g.caption = (f"micro-batch {s.micro_batch} x {e.n_micro} accumulation steps; activation "
                 f"checkpointing {s.ckpt_words}"
                 + ("; " + ", ".join(extras) if extras else ""))
    return g


def margin_words(gain: float, band: float) -> str:
    """What a relative margin means against the validated band."""
    if abs(gain) <= band:
        return f"within the +/-{band * 100:.0f} % band of the step-time model: a tie"
    return f"beyond the +/-{band * 100:.0f} % band of the step-time model"


def time_lines(e: Evaluation, best_baseline: tuple[str, Evaluation] | None) -> list[str]:
    from amsp_planner.validation import step_time_band

    t, band = e.time, step_time_band()
    lines = [
        f"step time {secs(t.step_s)} (+/-{band * 100:.0f} %, docs/validation.md) = compute "
        f"{secs(t.compute_s)} + kernels {secs(t.kernel_s)} + optimizer {secs(t.optimizer_s)} + "
        f"contention {secs(t.contention_s)} + exposed communication {secs(t.exposed_comm_s)} "
        f"(forward {secs(t.exposed_forward_s)}, backward {secs(t.exposed_backward_s)}, update "
        f"{secs(t.exposed_update_s)}); all collectives {secs(t.comm_total_s)}",
        f"{e.tokens_per_s:,.0f} tokens/s, MFU {e.mfu * 100:.1f}%, memory {gib(e.memory.total)} of "
        f"{gib(e.memory_limit)} GiB per GPU",
    ]
    if best_baseline is not None:
        name, b = best_baseline
        gain = b.step_s / e.step_s - 1
        lines.append(f"vs best named baseline {name} ({b.strategy}): {gain * 100:+.2f}% tokens/s "
                     f"({margin_words(gain, band)}), {gib(b.memory.total)} GiB per GPU")
    else:
        lines.append("no named baseline fits in memory")
    return lines
