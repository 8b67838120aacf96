"""Which named baselines a job runs as themselves (``strategy.baseline`` builds each), and the
pipeline and context-parallel degrees of a given strategy string."""

from __future__ import annotations

from amsp_planner.errors import AmspUserError
from amsp_planner.strategy import (
    BASELINE_NAMES,
    Strategy,
    baseline,
    parse_strategy_or_baseline,
)


def given_degrees(given: str, gpus: int, per_node: int, pp: int = 1) -> tuple[int, int]:
    """(pp, cp) of a given strategy string, over which its job's global batch splits
    (``Job.create``); a string that does not parse leaves (pp, 1): its own check names the
    fault later."""
    try:
        s = parse_strategy_or_baseline(given, gpus, per_node)
    except AmspUserError:
        return pp, 1
    return max(pp, s.pp), s.cp


def inapplicable_baselines(num_gpus: int, gpus_per_node: int) -> dict[str, str]:
    """Named baselines this job cannot run as themselves, each with the reason: they coincide
    with another baseline here (so they are left out of the comparison, never an error)."""
    n, r = num_gpus, gpus_per_node
    out = {}
    if n == 1:
        return {name: "one GPU: nothing to shard" for name in BASELINE_NAMES if name != "ddp"}
    if n <= r:
        one = f"one node: its shard group would be all {n} GPUs, which is zero3"
        return {"hsdp": one, "mics": one}
    m = baseline("mics", n, r)
    if m.s_p == min(n, r):
        out["mics"] = (f"its largest shard group that divides {n} GPUs is one node ({m.s_p}), "
                       "which is hsdp")
    elif m.s_p == n:
        out["mics"] = f"its 2-node shard group is the whole job ({n} GPUs), which is zero3"
    return out


def named_baselines(num_gpus: int, gpus_per_node: int, micro_batch: int = 1,
                    ckpt: bool | int | str = False, tp: int = 1) -> dict[str, Strategy]:
    """The named baselines this N and R run as themselves (``inapplicable_baselines`` says why
    the others are left out); on one node zeropp stays, as qwZ + qgZ without hpZ. With `tp`,
    over the data-parallel ranks of that tensor-parallel degree."""
    skip = inapplicable_baselines(num_gpus // tp, max(1, gpus_per_node // tp))
    return {name: baseline(name, num_gpus, gpus_per_node, micro_batch, ckpt, tp)
            for name in BASELINE_NAMES if name not in skip}


def with_micro_batch(strategy: str, mb: int) -> str:
    """--strategy with --micro-batch: the strategy's own mb= must agree; without one it takes
    the option's (a baseline name such as zero3 otherwise runs mb=1)."""
    own = [v.strip() for k, _, v in (x.partition("=") for x in strategy.split(","))
           if k.strip().lower() == "mb"]
    if own and not (own[0].isascii() and own[0].isdigit()):
        return strategy  # the strategy's own parse names the bad value
    if own and int(own[0]) != mb:
        raise AmspUserError(f"--micro-batch {mb}: --strategy {strategy} fixes the micro-batch "
                            f"(mb={own[0]}): drop one of them, or make them agree")
    return strategy if own else f"{strategy},mb={mb}"


def check_ds_micro_batch(s: Strategy, mb: int | None, path: str) -> None:
    """--micro-batch beside --strategy-from: the config's train_micro_batch_size_per_gpu
    decides the micro-batch, so a different option is refused, not ignored."""
    if mb is not None and s.micro_batch != mb:
        raise AmspUserError(f"--micro-batch {mb}: --strategy-from {path} runs micro-batch "
                            f"{s.micro_batch} (train_micro_batch_size_per_gpu): drop one of "
                            "them, or make them agree")
