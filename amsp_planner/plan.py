"""Plan files: versioned JSON that training jobs consume.

A plan holds the full inputs (model, cluster and training specs, GPU count, memory limit) with
the SHA-256 of each one's canonical JSON, the decision, the predictions (memory, the collective
schedule the runtime executes, step time, tokens/s, MFU), runners-up, every named baseline,
and solver statistics. Fields that change from run to run (tool version, creation time, solve
time) live under ``volatile`` and are left out of ``digest``, the SHA-256 of everything else,
so golden files compare and hand edits are caught.

Loading checks, in order: JSON syntax, format and version, the schema, the spec hashes, the
digest, and then every field that repeats the decision: the decision is its strategy string,
and the components (factors, meshes, scopes), the ZeRO++ switches, micro-batch, accumulation,
checkpointing, tensor-parallel degree and version are re-derived from it, the predictions
(``fits``, memory, time, every schedule entry and its names) from the cost model on the job,
the search record from the inputs, and every runner-up, reference and named baseline from its
own strategy. Any disagreement is refused in one line naming the field, also when the digest
was recomputed after the edit (as a script that rewrites a plan does).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from amsp_planner import __version__
from amsp_planner.cost.evaluate import Evaluation, evaluate
from amsp_planner.cost.job import Job
from amsp_planner.engines import DEFAULT_ENGINE
from amsp_planner.errors import AmspUserError, format_validation_error
from amsp_planner.plan_decision import decision, plan_version
from amsp_planner.plan_diff import _refuse_difference, _same, _show
from amsp_planner.plan_schema import (  # noqa: F401 - also this module's API
    FORMAT,
    SUPPORTED_VERSIONS,
    VERSION,
    Component,
    Decision,
    Hashes,
    Inputs,
    PlanDoc,
    PreferenceDoc,
    Search,
    SolverInfo,
    Summary,
    Volatile,
    canonical,
    content_digest,
    json_schema,
    sha256,
)
from amsp_planner.strategy import Strategy


# ----- building -----------------------------------------------------------------------------
def summary(e: Evaluation) -> dict:
    return {
        "strategy": str(e.strategy), "fits": e.fits, "step_s": e.step_s,
        "memory_bytes": e.memory.total, "tokens_per_s": e.tokens_per_s, "mfu": e.mfu,
        "inter_bytes_per_rank_per_step": e.bytes_per_rank("inter"),
        "intra_bytes_per_rank_per_step": e.bytes_per_rank("intra"),
    }


def bands(job: Job | None = None) -> dict:
    """The validated relative errors every prediction of the plan carries (docs/validation.md):
    the 90th-percentile |error| of step time (and tokens/s; a mixture of experts' the larger
    with its own runs'), the worst of peak memory."""
    from amsp_planner.validation import memory_band, step_time_band

    band = step_time_band(job)
    return {"step_time": band, "tokens_per_s": band,
            "memory": memory_band(), "statistic": {"step_time": "p90 |error|",
                                                   "memory": "max |error|"},
            "source": "docs/validation.md"}


def build_doc(job: Job, best: Evaluation, *, runners_up: list[Evaluation] = (),
              baselines: dict[str, Evaluation] | None = None, solver: dict | None = None,
              objective: str = "time", search: dict | None = None, solve_time_s: float = 0.0,
              build_time_s: float = 0.0, references: dict[str, Evaluation] | None = None) -> dict:
    specs = {
        "model": job.model.model_dump(mode="json"),
        "cluster": job.cluster.model_dump(mode="json"),
        "training": job.training.model_dump(mode="json"),
    }
    dec = decision(best, job.gpus_per_node, job.num_gpus)
    doc = {
        "format": FORMAT,
        "version": plan_version(dec, job.training.precision == "fp8"),
        "inputs": {
            **specs,
            "num_gpus": job.num_gpus,
            "memory_limit_bytes": best.memory_limit,
            "objective": objective,
            **({"engine": job.engine} if job.engine != DEFAULT_ENGINE else {}),
            "search": search or {},
            "hashes": {k: sha256(v) for k, v in specs.items()},
        },
        "decision": dec,
        "predictions": {**best.to_dict(), "bands": bands(job),
                        "references": {k: summary(e) for k, e in (references or {}).items()}},
        "runners_up": [summary(e) for e in runners_up],
        "baselines": {k: summary(e) for k, e in (baselines or {}).items()},
        "solver": solver or {"name": "none", "status": "given strategy", "objective": objective},
    }
    doc = json.loads(canonical_text(doc))  # exactly what a reader will see
    doc["digest"] = content_digest(doc)
    doc["volatile"] = {
        "tool_version": __version__,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "solve_time_s": solve_time_s,
        "build_time_s": build_time_s,
    }
    return doc


def canonical_text(doc: dict) -> str:
    return json.dumps(doc, indent=2, allow_nan=False) + "\n"


# ----- writing ------------------------------------------------------------------------------
def is_plan_file(path: Path) -> bool:
    try:
        with open(path) as f:
            head = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(head, dict) and head.get("format") == FORMAT


def write_plan(path: str | Path, doc: dict) -> Path:
    """Write atomically; replace an earlier plan, never another kind of file."""
    from amsp_planner.outfile import write_output

    return write_output(path, "-o", "an amsp plan", is_plan_file, canonical_text(doc))


# ----- loading ------------------------------------------------------------------------------
@dataclass
class Plan:
    """A loaded, checked plan."""

    doc: dict
    job: Job
    strategy: Strategy
    evaluation: Evaluation
    memory_limit: float
    path: Path | None = None

    @property
    def schedule(self) -> list[dict]:
        return self.doc["predictions"]["schedule"]


def load_plan(path: str | Path) -> Plan:
    path = Path(path)
    from amsp_planner.textfile import read_text

    try:
        text = read_text(path, fix="give the plan file amsp plan -o wrote")
    except OSError as e:
        raise AmspUserError(f"{path}: cannot read the plan ({e.strerror}): check the path") from None
    except UnicodeDecodeError:
        raise AmspUserError(f"{path}: not UTF-8 text, so not an amsp plan: give the JSON file "
                            "amsp plan -o wrote") from None
    from amsp_planner.textfile import BadContent, parse

    try:
        raw = parse(text, "json")
    except BadContent as e:
        raise AmspUserError(f"{path}: not a valid plan file ({e}); it is truncated, corrupted "
                            "or edited: regenerate it with amsp plan") from None
    return plan_from_doc(raw, str(path))


def plan_from_doc(raw: Any, source: str = "plan") -> Plan:
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise AmspUserError(f"{source}: not an amsp plan (field 'format' must be '{FORMAT}')")
    version = raw.get("version")
    if version not in SUPPORTED_VERSIONS or isinstance(version, bool):
        raise AmspUserError(
            f"{source}: plan version {version!r} is not supported (this amsp reads versions "
            f"{', '.join(map(str, SUPPORTED_VERSIONS))}): regenerate it with this amsp's `amsp plan`"
        )
    try:
        doc = PlanDoc.model_validate(raw)
    except ValidationError as e:
        raise AmspUserError(format_validation_error(e, source)) from None
    if version == 1 and not isinstance(doc.decision.ckpt, bool):
        raise AmspUserError(f"{source}: field 'decision.ckpt' is {doc.decision.ckpt!r}, but a "
                            "version 1 plan holds true or false: regenerate it with amsp plan")
    if version < 3 and doc.decision.tp > 1:
        raise AmspUserError(f"{source}: field 'decision.tp' is {doc.decision.tp}, but a version "
                            f"{version} plan has no tensor parallelism: regenerate it with amsp plan")
    if version < 4 and doc.decision.experts is not None:
        raise AmspUserError(f"{source}: field 'decision.experts' is set, but a version {version} "
                            "plan has no expert parallelism: regenerate it with amsp plan")
    if version < 5 and doc.decision.pipeline is not None:
        raise AmspUserError(f"{source}: field 'decision.pipeline' is set, but a version {version} "
                            "plan has no pipeline parallelism: regenerate it with amsp plan")
    if version < 4 and doc.decision.ckpt == "moe":
        raise AmspUserError(f"{source}: field 'decision.ckpt' is \"moe\", but a version {version} "
                            "plan has no MoE checkpointing: regenerate it with amsp plan")
    inp = doc.inputs
    for key in ("model", "cluster", "training"):
        got = sha256(raw["inputs"][key])
        if got != getattr(inp.hashes, key):
            raise AmspUserError(
                f"{source}: field 'inputs.{key}' does not match its hash in 'inputs.hashes.{key}' "
                "(the spec was edited): regenerate the plan with amsp plan"
            )
    if content_digest(raw) != doc.digest:
        raise AmspUserError(
            f"{source}: field 'digest' does not match the contents (the plan was edited by hand): "
            "regenerate it with amsp plan"
        )
    try:
        pipe = doc.decision.pipeline
        job = Job.create(inp.model, inp.cluster, inp.training, inp.num_gpus, inp.engine,
                         pp=pipe.pp if pipe is not None else 1, cp=doc.decision.cp)
        if job.training.precision == "fp8":  # recipe, gather and GPU, as amsp plan checks them
            from amsp_planner.cost.fp8 import check_training

            check_training(job.training, job.engine, job.cluster.gpu.arch)
    except AmspUserError as e:
        raise AmspUserError(f"{source}: field '{_input_field(str(e))}': {e}") from None
    strategy, ev = _derive(raw, doc, job, source)
    _check_search(raw, job, strategy, source)
    pref = doc.inputs.search.preference
    if pref is not None and doc.inputs.search.given_strategy is None:  # searched under it
        usable = inp.memory_limit_bytes * (1 - pref.headroom)
        if ev.memory.total > usable * (1 + 1e-6):
            raise AmspUserError(
                f"{source}: field 'inputs.search.preference.headroom' is {pref.headroom:g}, but "
                f"the decision uses {ev.memory.total / 2**30:.2f} GiB per GPU, more than the "
                f"{usable / 2**30:.2f} GiB it leaves: regenerate the plan")
    basis = f"the cost model gives {{}} for decision.strategy '{doc.decision.strategy}'"
    want = json.loads(canonical_text(ev.to_dict()))
    want["strategy"] = doc.decision.strategy
    stored = {k: v for k, v in raw["predictions"].items() if k not in ("bands", "references")}
    _refuse_difference(stored, want, "predictions", basis, source)
    _check_summaries(raw, job, ev, source)
    return Plan(raw, job, strategy, ev, inp.memory_limit_bytes,
                Path(source) if source != "plan" else None)


_FLAG_FIELDS = {"--fp8-recipe": "inputs.training.fp8_recipe",
                "--fp8-all-gather": "inputs.training.fp8_all_gather",
                "--precision": "inputs.training.precision"}
"""The plan field of a job setting whose refusal is worded by its amsp plan option."""


def _input_field(message: str) -> str:
    """The field of 'inputs' a refusal of the job is about: the one its option names, else
    'inputs' itself."""
    return _FLAG_FIELDS.get(message.split(" ", 1)[0].rstrip(":"), "inputs")


# ----- the fields that repeat the decision ---------------------------------------------------
def _derive(raw: dict, doc: PlanDoc, job: Job, source: str) -> tuple[Strategy, Evaluation]:
    """The decision's strategy with its accumulation, and its evaluation, once every field of
    ``decision`` (and ``version``) agrees with the strategy string."""
    dec = doc.decision
    try:
        parsed = Strategy.parse(dec.strategy)
        n = job.n_micro(parsed)
        job.check(parsed)
    except AmspUserError as e:
        raise AmspUserError(f"{source}: field 'decision.strategy': {e}") from None
    if parsed.grad_accum is not None:
        raise AmspUserError(f"{source}: field 'decision.strategy' holds ga=: the accumulation "
                            "belongs in 'decision.grad_accum': regenerate the plan")
    strategy = parsed.with_(grad_accum=n)
    try:  # what only pricing refuses: an FP8 gather (fp8ag) the job cannot run
        ev = evaluate(job, strategy, doc.inputs.memory_limit_bytes)
    except AmspUserError as e:
        raise AmspUserError(f"{source}: field 'decision.strategy': {e}") from None
    want = json.loads(canonical_text(decision(ev, job.gpus_per_node, job.num_gpus)))
    got = dict(raw["decision"])
    if got.get("tp", 1) == 1 and want.get("tp", 1) == 1:
        got.pop("tp", None)
    basis = f"field 'decision.strategy' = '{dec.strategy}' gives {{}}"
    _refuse_difference(got, want, "decision", basis, source)
    v = plan_version(want, job.training.precision == "fp8")
    if raw["version"] != v:
        raise AmspUserError(
            f"{source}: field 'version' is {raw['version']}, but a plan of decision.strategy "
            f"'{dec.strategy}' in {job.training.precision} is version {v}: regenerate it with "
            "amsp plan")
    return strategy, ev


def _check_search(raw: dict, job: Job, strategy: Strategy, source: str) -> None:
    """The search record against the training spec and the decision it produced."""
    search, training = raw["inputs"].get("search", {}), raw["inputs"]["training"]
    for key in ("micro_batch", "activation_checkpointing"):
        if key in search and not _same(search[key], training.get(key)):
            raise AmspUserError(
                f"{source}: field 'inputs.search.{key}' is {_show(search[key])}, but "
                f"inputs.training.{key} is {_show(training.get(key))}: regenerate the plan")
    given = search.get("given_strategy")
    if given is not None:  # the given strategy fixes what the search would have pinned
        _check_given(given, job, strategy, source)
        return
    mb = training.get("micro_batch")
    if mb is not None and strategy.micro_batch != mb:
        raise AmspUserError(
            f"{source}: field 'decision.micro_batch' is {strategy.micro_batch}, but "
            f"inputs.training.micro_batch pins it to {mb}: regenerate the plan")
    if search.get("zeropp") is False and (strategy.qwz or strategy.qgz or strategy.hpz > 1):
        raise AmspUserError(
            f"{source}: field 'decision.strategy' ({strategy.with_(grad_accum=None)}) uses ZeRO++ "
            "(qwz, hpz or qgz), but inputs.search.zeropp is false: regenerate the plan")
    if search.get("ep") is not None and search["ep"] != strategy.ep:
        raise AmspUserError(f"{source}: field 'decision.experts.ep' is {strategy.ep}, but "
                            f"inputs.search.ep pins it to {search['ep']}: regenerate it with amsp plan")
    if search.get("tp") is not None and search["tp"] != strategy.tp:
        raise AmspUserError(
            f"{source}: field 'decision.tp' is {strategy.tp}, but inputs.search.tp pins it to "
            f"{search['tp']}: regenerate the plan")


def _check_given(given: str, job: Job, strategy: Strategy, source: str) -> None:
    """A plan of a given strategy (``amsp plan --strategy``) decides that strategy."""
    from amsp_planner.strategy import parse_strategy_or_baseline

    try:
        g = parse_strategy_or_baseline(given, job.num_gpus, job.gpus_per_node)
    except AmspUserError as e:
        raise AmspUserError(f"{source}: field 'inputs.search.given_strategy': {e}") from None
    from amsp_planner.cost.evaluate import as_priced

    g = as_priced(job, g)  # --fp8-all-gather on writes fp8ag into it (amsp plan)
    if str(g.with_(grad_accum=None)) != str(strategy.with_(grad_accum=None)):
        raise AmspUserError(
            f"{source}: field 'decision.strategy' is '{strategy.with_(grad_accum=None)}', but "
            f"inputs.search.given_strategy is '{given}' ({g.with_(grad_accum=None)}): "
            "regenerate the plan")


def _check_summaries(raw: dict, job: Job, ev: Evaluation, source: str) -> None:
    """Runners-up and references against the cost model on their own strategies; the named
    baselines against the set the plan's micro-batch, checkpointing and TP degree give."""
    from amsp_planner.cost.evaluate import evaluate_baselines

    limit = raw["inputs"]["memory_limit_bytes"]
    s = ev.strategy
    try:
        base = evaluate_baselines(job, limit, s.micro_batch, s.ckpt_value, s.tp, s.cp)
    except AmspUserError:  # a pipeline's batch that does not divide over pp=1's ranks
        if s.pp == 1:
            raise
        base = {}  # as amsp plan writes it: "named baselines (pp=1) not priced"
    names = sorted(base)
    if sorted(raw["baselines"]) != names:
        raise AmspUserError(
            f"{source}: field 'baselines' names {_show(sorted(raw['baselines']))}, "
            f"but this job's named baselines are {', '.join(names)} (the plan was edited, or "
            "made by another amsp version): regenerate it with amsp plan")
    for name in names:
        want = json.loads(canonical_text(summary(base[name])))
        _refuse_difference(raw["baselines"][name], want, f"baselines.{name}",
                           f"the cost model gives {{}} for baseline {name}", source)
    refs = raw["predictions"].get("references", {})
    if not isinstance(refs, dict):
        raise AmspUserError(f"{source}: field 'predictions.references' is {_show(refs)}, not an "
                            "object of named summaries: regenerate the plan")
    items = [(f"predictions.references.{k}", v) for k, v in refs.items()]
    items += [(f"runners_up[{i}]", v) for i, v in enumerate(raw["runners_up"])]
    for where, stored in items:
        try:
            Summary.model_validate(stored)
        except ValidationError as e:
            err = e.errors()[0]
            at = ".".join([where, *map(str, err["loc"])])
            raise AmspUserError(f"{source}: field '{at}': {err['msg']}") from None
        try:
            other = evaluate(job, Strategy.parse(stored["strategy"]), limit)
        except AmspUserError as e:
            raise AmspUserError(f"{source}: field '{where}.strategy': {e}") from None
        want = json.loads(canonical_text(summary(other)))
        _refuse_difference(stored, want, where,
                           f"the cost model gives {{}} for field '{where}.strategy' = "
                           f"'{stored['strategy']}'", source)
