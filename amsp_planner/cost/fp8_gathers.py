"""Which parameter all-gathers move FP8 weights, and their bytes per unit: FSDP/ZeRO-3
gathers with ``fp8ag`` or ``--fp8-all-gather on`` (torchao's tensorwise FP8 all-gather, the
bundled runtime's), and Transformer Engine's FP8 parameter gather of the distributed optimizer
(Megatron's ``--fp8-param-gather``). cost/schedule.py prices the collectives; the bytes per
unit are cost/fp8_bytes.py's ``unit_gathers``. No torch."""

from __future__ import annotations

from amsp_planner.cost.job import Job
from amsp_planner.cost.unit_tensors import unit_elements
from amsp_planner.strategy import Strategy


def gathers_fp8(job: Job, s: Strategy) -> bool:
    """Whether `s` gathers its parameters in FP8: s_P > 1 and ``fp8ag``, or ``--fp8-all-gather
    on`` (every gather in FP8: a strategy written without ``fp8ag``, a named baseline)."""
    t = job.training
    return s.s_p > 1 and (s.fp8ag or t.precision == "fp8" and t.fp8_all_gather == "on"
                          and not job.model.is_moe)


def te_param_gathers(job: Job, tp: int = 1):
    """Transformer Engine engines with ``--fp8-all-gather on`` (Megatron's
    ``--fp8-param-gather``: FP8 primary weights): the distributed optimizer's all-gather of the
    updated parameters moves the FP8 weights, one unit of each class as ``unit_gathers``
    prices it; None where it gathers in the parameters' dtype."""
    from amsp_planner.cost.fp8 import GATHER_ONLY, family_of, fp8_all_gather_supported

    t = job.training
    if t.precision != "fp8" or t.fp8_all_gather != "on" or job.model.is_moe \
            or job.engine in GATHER_ONLY or family_of(job.engine) != "te":
        return None
    from amsp_planner.cost.fp8 import check_training
    from amsp_planner.cost.fp8_bytes import unit_gathers

    if not fp8_all_gather_supported(check_training(t, job.engine, job.cluster.gpu.arch),
                                    job.engine):
        return None
    return unit_gathers(job, unit_elements(job, tp), tp)


def fp8_gathers(job: Job, tp: int = 1):
    """The FP8 all-gather of one unit of each class (``cost/fp8_bytes.py: unit_gathers``);
    a user error without ``--precision fp8``."""
    from amsp_planner.cost.fp8_bytes import unit_gathers
    from amsp_planner.errors import AmspUserError

    if job.model.is_moe:
        raise AmspUserError(f"--strategy fp8ag: {job.model.name} is a mixture of experts, "
                            "whose FP8 gathers are not modelled: drop fp8ag")
    if job.training.precision != "fp8":
        raise AmspUserError("--strategy fp8ag: the FP8 all-gather needs --precision fp8: give "
                            "--precision fp8, or drop fp8ag")
    out = unit_gathers(job, unit_elements(job, tp), tp)
    if job.training.fp8_all_gather == "off" or not out[1].fp8:
        raise AmspUserError("--strategy fp8ag: this job does not gather FP8 weights "
                            "(--fp8-all-gather off, or a recipe other than tensorwise): drop "
                            "fp8ag, or give --fp8-recipe tensorwise --fp8-all-gather auto")
    return out
