"""The text of `amsp plan` and `amsp explain`."""

from __future__ import annotations

from amsp_planner.cost.evaluate import Evaluation
from amsp_planner.report.fmt import GIB, gib, secs
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


def band_words(band: float) -> str:
    """The tie band in words: the validated error of the predicted ratio of two strategies'
    step times (docs/validation.md, "Relative band"), or a band given with --tie-band."""
    return f"+/-{band * 100:.1f} % relative band"


def margin_words(gain: float, band: float) -> str:
    """What a relative margin means against the tie band."""
    if abs(gain) <= band:
        return f"within the {band_words(band)}: a tie"
    return f"beyond the {band_words(band)}"


def preferred_for(job, chosen: Evaluation, other: Evaluation, pref) -> list[str]:
    """Why `chosen` is preferred to `other` by the planner's rule, in words (empty when
    nothing but speed separates them)."""
    out = []
    if other.memory.total > pref.usable(other.memory_limit):
        free = other.memory_limit - other.memory.total
        out.append(f"{other.strategy} leaves {gib(max(free, 0))} GiB free, under the "
                   f"{pref.headroom * 100:.0f} % headroom" if other.fits else
                   f"{other.strategy} does not fit")
        return out
    if other.strategy.quantized and not chosen.strategy.quantized:
        out.append("lossless numerics")
    from amsp_planner.solver.brute import criterion
    from amsp_planner.solver.space import GROUPS, MEMORY, RECOMPUTE, STEP

    rc, ro = criterion(job, chosen, RECOMPUTE), criterion(job, other, RECOMPUTE)
    if ro > rc * (1 + 1e-6) + 1e-9:
        out.append("no checkpointing recompute" if rc == 0 else
                   f"{secs(ro - rc)} less checkpointing recompute")
    gc, go = int(criterion(job, chosen, GROUPS)), int(criterion(job, other, GROUPS))
    if gc < go:
        out.append(f"{go - gc} fewer process group{'s' if go - gc > 1 else ''} ({gc} vs {go})")
    dm = other.memory.total - chosen.memory.total
    tb = pref.tie_breaks
    # memory is a reason only where the rule puts it before the step, or the steps are equal
    by_memory = MEMORY in tb and (STEP not in tb or tb.index(MEMORY) < tb.index(STEP)
                                  or chosen.step_s <= other.step_s * (1 + 1e-6))
    if dm >= 0.005 * GIB and by_memory:
        out.append(f"{gib(dm)} GiB less memory")
    return out


def margin_line(job, label: str, chosen: Evaluation, other: Evaluation, pref) -> str:
    """`chosen` against `other`: its tokens/s margin, what the margin means against the band,
    and what the rule chose `chosen` for."""
    gain = other.step_s / chosen.step_s - 1
    band = pref.band
    words = margin_words(gain, band)
    why = preferred_for(job, chosen, other, pref) if gain <= band * (1 + 1e-9) else []
    if why:
        words += "; chosen for " + _join(why)
    headroom = chosen.memory_limit - chosen.memory.total
    return (f"vs {label} ({other.strategy}): {gain * 100:+.2f}% tokens/s ({words}); "
            f"{gib(headroom)} GiB of headroom against {gib(other.memory_limit - other.memory.total)}")


def _join(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def time_lines(e: Evaluation, best_baseline: tuple[str, Evaluation] | None, job,
               pref=None, refs: dict | None = None) -> list[str]:
    """The step time with its band, throughput and memory with theirs, and the margins
    against the fastest candidates (`refs`) and the best named baseline."""
    from amsp_planner.solver.space import Preference
    from amsp_planner.validation import memory_band, step_time_band

    t, band, mband = e.time, step_time_band(job), memory_band()
    pref = pref or Preference.default(job=job)
    lines = [
        f"step time {secs(t.step_s)} (+/-{band * 100:.0f} %, docs/validation.md) = compute "
        f"{secs(t.compute_s)} + kernels {secs(t.kernel_s)} + optimizer {secs(t.optimizer_s)} + "
        f"contention {secs(t.contention_s)} + exposed communication {secs(t.exposed_comm_s)} "
        f"(forward {secs(t.exposed_forward_s)}, backward {secs(t.exposed_backward_s)}, update "
        f"{secs(t.exposed_update_s)}" + (f", TP {secs(t.tp_comm_s)}" if t.tp_comm_s else "")
        + (f", all-to-alls {secs(t.ep_comm_s)}" if t.ep_comm_s else "")
        + (f", pipeline sends {secs(t.p2p_s)}" if t.p2p_s else "") + ")"
        + (f" + pipeline bubble {secs(t.bubble_s)}" if t.bubble_s else "")
        + (f" + the slowest rank's lag {secs(t.straggler_s)}" if t.straggler_s else "")
        + (f" + per-rank sync {secs(t.sync_s)}" if t.sync_s else "")
        + f"; all collectives {secs(t.comm_total_s)}",
        f"{e.tokens_per_s:,.0f} tokens/s (+/-{band * 100:.0f} %), MFU {e.mfu * 100:.1f}%, "
        f"memory {gib(e.memory.total)} (+/-{mband * 100:.0f} %) of {gib(e.memory_limit)} GiB "
        f"per GPU",
    ]
    seen = {str(e.strategy)}
    for key, label in (("fastest", "the fastest candidate"),
                       ("fastest_lossless", "the fastest lossless candidate")):
        other = (refs or {}).get(key)
        if other is not None and str(other.strategy) not in seen:
            seen.add(str(other.strategy))
            lines.append(margin_line(job, label, e, other, pref))
    if best_baseline is not None:
        name, b = best_baseline
        lines.append(margin_line(job, f"the best named baseline {name}", e, b, pref))
    else:
        lines.append("no named baseline fits in memory" + (" (without pipeline stages)"
                                                           if e.strategy.pp > 1 else ""))
    return lines
