"""What every exporter shares: the result type and "closest expressible strategy".

An exporter is a pure function ``(job, strategy, memory_limit) -> ExportResult``. Each target can
express only part of the AMSP space (DeepSpeed: three ZeRO stages plus ZeRO++ switches; FSDP2:
one shard factor for P, G and OS; ...). The exporter lists that part, as Strategy values that keep
the plan's micro-batch, accumulation and checkpointing, and:

- the part is the target engine's search space (amsp_planner/engines.py, SearchSpace.for_job),
  so a plan made with ``--engine T`` is always in it;
- if the plan's strategy is in it, exports it as is (``exact=True``);
- otherwise exports the candidate the cost model rates best: one that fits in memory with the
  lowest step time, else the one needing the least memory (``exact=False``). The differences
  name each changed knob and its predicted cost: step time and memory per GPU, before and after.
- candidates are priced as the target runs them (its gradient-reduction dtype); when that
  differs from the plan's job, the differences say so and price it, even when exact.

No guessing: the choice is ``min`` over evaluated candidates, so a test can re-evaluate them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from amsp_planner.cost.evaluate import Evaluation, evaluate
from amsp_planner.cost.job import Job
from amsp_planner.errors import AmspUserError
from amsp_planner.strategy import Strategy

GIB = 1024**3


@dataclass(frozen=True)
class ExportResult:
    """One export: the file text and how faithfully it expresses the plan."""

    target: str
    """deepspeed, fsdp2, torchtitan or internevo."""
    text: str
    """The file contents, ready to write."""
    exact: bool
    """True when the file expresses the plan's strategy itself."""
    closest: Strategy
    """The strategy the file expresses (the plan's own when exact)."""
    differences: tuple[str, ...] = ()
    """One line per changed knob, then one with the predicted cost; empty when exact."""
    notes: tuple[str, ...] = ()
    """Caveats that hold even when exact (what the target does that the cost model abstracts)."""


def try_evaluate(job: Job, s: Strategy, memory_limit: float | None) -> Evaluation | None:
    """evaluate(), or None when `s` is not valid for this job (a candidate to skip)."""
    try:
        return evaluate(job, s, memory_limit)
    except AmspUserError:
        return None


def rank_key(e: Evaluation) -> tuple:
    """Fits first, then lowest step time, then least memory; the string breaks exact ties."""
    return (not e.fits, e.step_s if e.fits else e.memory.total, e.memory.total, str(e.strategy))


def closest_expressible(job: Job, plan: Strategy, candidates: Iterable[Strategy],
                        memory_limit: float | None, target: str, target_job: Job | None = None
                        ) -> tuple[Strategy, bool, Evaluation, Evaluation]:
    """(closest, exact, plan evaluation, closest evaluation) among `candidates`.

    The plan is priced on its own job; the candidates on `target_job` (default the same), the
    job as the target engine runs it.
    """
    tjob = job if target_job is None else target_job
    plan_eval = evaluate(job, plan, memory_limit)
    cands = list(dict.fromkeys(candidates))
    if plan in cands:
        return plan, True, plan_eval, (plan_eval if tjob == job
                                       else evaluate(tjob, plan, memory_limit))
    evals = [e for e in (try_evaluate(tjob, c, memory_limit) for c in cands) if e is not None]
    if not evals:
        raise AmspUserError(
            f"--to {target}: none of the strategies {target} can express is valid for "
            f"{job.num_gpus} GPUs ({job.gpus_per_node} per node): use another target"
        )
    best = min(evals, key=rank_key)
    return best.strategy, False, plan_eval, best


def expressible(job: Job, plan: Strategy) -> list[Strategy]:
    """Every strategy ``job.engine`` runs exactly (its SearchSpace, ZeRO++ included), with the
    plan's micro-batch, accumulation and checkpointing (every checkpointing setting the engine
    runs, when it does not run the plan's); for a mixture of experts, each dense one with the
    experts following it and with every expert setting the engine runs (exports/moe.py)."""
    from amsp_planner.solver.space import SearchSpace

    ck = plan.ckpt_value
    if not job.profile.runs_ckpt(ck, job.model.num_layers):
        ck = None
        if job.training.activation_checkpointing is not None:  # the plan's pinned setting:
            from dataclasses import replace  # every setting the engine runs instead

            job = replace(job, training=job.training.model_copy(
                update={"activation_checkpointing": None}))
    # the plan's tensor-parallel degree where the engine runs it, else data parallel only
    # (with the micro-batch searched: the sequences per rank change with the degree)
    tp = plan.tp if plan.tp in job.tp_options() else 1
    mb = plan.micro_batch if tp == plan.tp else None
    ck = ck if tp == plan.tp else None
    space = SearchSpace.for_job(job, micro_batch=mb, ckpt=ck, tp=tp)
    ga = plan.grad_accum if tp == plan.tp and plan.pp == 1 else None  # stages: their own
    cands = [c.with_(grad_accum=ga) for c in space.candidates(job)]
    if job.model.is_moe:  # the engine's expert settings with each dense one (exports/moe.py)
        from amsp_planner.exports.moe import with_experts

        cands = with_experts(job.engine, job.model.num_experts, job.num_gpus,
                             job.gpus_per_node, cands)
    return cands


def behaviour_differences(job: Job, target_job: Job, s: Strategy | None = None) -> list[str]:
    """What the target engine runs differently from the plan's job, beyond the strategy: its
    gradient dtype, the execution-profile values that separate the two engines' prices
    (engines.execution_differences), and, where strategy `s` checkpoints whole blocks, whether
    the recomputation stops early (``EngineProfile.ckpt_early_stop``)."""
    from amsp_planner.ckpt_setting import checkpointed_blocks, stops_early
    from amsp_planner.engines import execution_differences

    a, b = job.training, target_job.training
    out = []
    if a.grad_accum_dtype != b.grad_accum_dtype:
        out.append(f"gradient dtype {a.grad_dtype_name} -> {b.grad_dtype_name}: "
                   f"{target_job.profile.title} reduces gradients "
                   f"{target_job.profile.reduce_source}")
    ex = execution_differences(job.profile, target_job.profile)
    tp = s.tp if s else 1
    stop = (stops_early(job, tp), stops_early(target_job, tp))
    k, op = checkpointed_blocks(s.ckpt_value, job.model.num_layers) if s else (0, False)
    if k and not op and stop[0] != stop[1]:
        ex.append(f"ckpt_early_stop {'on' if stop[0] else 'off'} -> {'on' if stop[1] else 'off'} "
                  "(whether a checkpointed block's recomputation skips its last linear)")
    if ex:
        out.append(f"{target_job.profile.title} executes {', '.join(ex)} (its execution profile, "
                   "amsp_planner/engines.py)")
    return out


def translate(job: Job, plan: Strategy, engine: str, memory_limit: float | None,
              why: dict[str, str] | None = None) -> tuple[Strategy, bool, Job, list[str]]:
    """The plan as `engine` runs it: (strategy, exact, the engine's job, difference lines).

    exact: the engine runs the plan's strategy as written. The lines name each changed knob
    (with the reason from `why`) and what the engine does differently, then the predicted
    cost of the change; none when the engine runs the plan as predicted.
    """
    tjob = job.for_engine(engine)
    if plan.pp > 1:  # an engine that runs the stages runs the plan as made
        from amsp_planner.cost.evaluate import engine_runs

        if engine_runs(tjob, plan) is None:
            pe, ce = evaluate(job, plan, memory_limit), evaluate(tjob, plan, memory_limit)
            diffs = behaviour_differences(job, tjob, plan)
            return plan, True, tjob, diffs + [cost_difference(pe, ce)] if diffs else []
    closest, exact, pe, ce = closest_expressible(job, plan, expressible(tjob, plan),
                                                 memory_limit, engine, tjob)
    diffs: list[str] = []
    if not exact:
        why = why or {}
        groups: dict[str | None, list[str]] = {}  # knobs given up for one reason, together
        for knob, line, lost in knob_differences(plan, closest):
            groups.setdefault(why.get(knob) if lost else None, []).append(line)
        diffs += [f"{', '.join(lines)}: {reason}" if reason else ", ".join(lines)
                  for reason, lines in groups.items()]
    diffs += behaviour_differences(job, tjob, closest)
    if diffs:
        diffs.append(cost_difference(pe, ce))
    return closest, exact, tjob, diffs


def knob_differences(plan: Strategy, closest: Strategy) -> list[tuple[str, str, bool]]:
    """(knob, line, lost) per sharding knob that differs; lost: the plan's setting is given up
    (a factor changed, or a feature the plan uses is off), as opposed to a feature added."""
    out = []
    if plan.tp != closest.tp:
        out.append(("tp", f"tp {plan.tp} -> {closest.tp}", True))
    for name, attr in (("s_P", "s_p"), ("s_G", "s_g"), ("s_OS", "s_os"), ("hpZ", "hpz")):
        a, b = getattr(plan, attr), getattr(closest, attr)
        if a != b:
            out.append((name, f"{name} {a} -> {b}", attr != "hpz" or a > 1))
    for name in ("qwz", "qgz"):
        a, b = getattr(plan, name), getattr(closest, name)
        if a != b:
            out.append((name, f"{name} {'on' if a else 'off'} -> {'on' if b else 'off'}", a))
    if plan.micro_batch != closest.micro_batch:
        out.append(("micro-batch", f"micro-batch {plan.micro_batch} -> {closest.micro_batch}",
                    False))
    if plan.ckpt_value != closest.ckpt_value:
        out.append(("checkpointing", f"checkpointing {plan.ckpt_words} -> {closest.ckpt_words}",
                    True))
    from amsp_planner.exports.moe import expert_knobs

    out += expert_knobs(plan, closest)
    quantized = (plan.qwz or plan.qgz) and (closest.qwz or closest.qgz)
    if quantized and plan.quant_block != closest.quant_block:
        out.append(("quantization", f"quantization block {plan.quant_block} -> "
                    f"{closest.quant_block}", True))
    return out


def cost_difference(plan_eval: Evaluation, closest_eval: Evaluation) -> str:
    """The predicted price of the change: step time and memory per GPU, before -> after."""
    a, b = plan_eval.step_s, closest_eval.step_s
    ma, mb = plan_eval.memory.total, closest_eval.memory.total
    limit = closest_eval.memory_limit
    fits = "fits" if closest_eval.fits else "does NOT fit"
    return (f"cost model: step time {a:.4f} s -> {b:.4f} s ({(b - a) * 1e3:+.1f} ms, "
            f"{(b - a) / a:+.2%}), memory per GPU {ma / GIB:.2f} -> {mb / GIB:.2f} GiB ({fits} in "
            f"{limit / GIB:.2f} GiB)")


def finish(target: str, job: Job, plan: Strategy, memory_limit: float | None, render,
           why: dict[str, str] | None = None, notes=None) -> ExportResult:
    """Pick what the target runs for the plan (``translate``), render it, state the
    differences.

    `render(job, strategy) -> text` (called with the job as the target runs it); `why` maps a
    knob name (s_P, hpZ, qwz, ...) to the reason the target cannot keep it, appended to that
    knob's difference line; `notes(closest)` lists the caveats of the exported strategy.
    """
    closest, exact, tjob, diffs = translate(job, plan, target, memory_limit, why)
    from amsp_planner.cost.activations import eager_loss_extras

    loss = eager_loss_extras(job)
    extra = [f"the plan prices {' and '.join(loss)} beside the cross-entropy; the exported "
             "configuration has no loss setting: the training script computes it"] if loss else []
    return ExportResult(target=target, text=render(tjob, closest), exact=exact, closest=closest,
                        differences=tuple(diffs),
                        notes=(tuple(notes(closest)) if notes else ()) + tuple(extra))
