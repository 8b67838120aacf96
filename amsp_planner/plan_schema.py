"""The plan file's schema and hashing: the format name and versions, the pydantic models of the
document (inputs, decision, predictions, solver statistics, volatile fields), its JSON Schema,
and the canonical JSON and SHA-256 digests. ``plan.py`` builds, writes and loads plans with
them and checks every field that repeats the decision.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from amsp_planner.engines import DEFAULT_ENGINE, ENGINES
from amsp_planner.specs.cluster import ClusterSpec
from amsp_planner.specs.model import ModelSpec
from amsp_planner.specs.training import TrainingSpec

FORMAT = "amsp-plan"
VERSION = 6
"""The newest version. A plan is written with the lowest version that holds its decision:
version 1 for checkpointing on or off (``decision.ckpt`` true or false), version 2 when it
checkpoints the first K blocks (``ckpt``: K) or op-level (``ckpt``: "op"), version 3 when it
is tensor-parallel (``decision.tp`` > 1, written only then), version 4 when it places a
mixture of experts' routed experts (``decision.experts``, written only then: docs/moe.md) or
recomputes only the MoE layers' MLP parts (``ckpt``: "moe"), version 5 when it is
context-parallel (``decision.cp`` > 1, written only then: cost/context_parallel.py) or has
pipeline stages (``decision.pipeline``, written only then), version 6 when it trains in FP8
(``inputs.training.precision`` fp8 with its ``fp8_recipe``, ``fp8ag`` in the strategy:
docs/fp8.md)."""
SUPPORTED_VERSIONS = (1, 2, 3, 4, 5, 6)


# ----- the document's schema ----------------------------------------------------------------
EngineName = Literal[ENGINES]
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Hashes(_Strict):
    model: str
    cluster: str
    training: str


class PreferenceDoc(_Strict):
    """The choice rule a plan was made with (``solver.space.Preference``)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    band: float = Field(ge=0, lt=1)
    headroom: float = Field(ge=0, lt=1)
    quantization: Literal["auto", "on", "off"]
    tie_breaks: list[Literal["recompute", "groups", "step", "memory"]]


class Search(BaseModel):
    """The restrictions the search ran under (the keys amsp plan writes, no others)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    zeropp: bool = True
    micro_batch: int | None = Field(default=None, ge=1)
    activation_checkpointing: bool | int | Literal["op", "moe"] | None = None
    given_strategy: str | None = None
    preference: PreferenceDoc | None = None
    tp: int | None = Field(default=None, ge=1)
    ep: int | None = Field(default=None, ge=1)
    pp: int | None = Field(default=None, ge=1)


class Inputs(_Strict):
    model: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    num_gpus: int = Field(ge=1, strict=True)  # not "8", 8.0 or true
    memory_limit_bytes: float = Field(gt=0)
    objective: Literal["time", "comm"] = "time"
    engine: EngineName = DEFAULT_ENGINE
    """The engine the plan was made for (amsp_planner/engines.py); written when not amsp, so
    plan files from before engines existed, and amsp plans, read as amsp."""
    search: Search = Field(default_factory=Search)
    """Restrictions the search ran under (zeropp, pinned micro-batch / checkpointing)."""
    hashes: Hashes


class Component(_Strict):
    factor: int = Field(ge=1)
    mesh: tuple[int, int]
    """(GPUs per node, nodes) of the shard group."""
    scope: Literal["none", "intra", "inter"]


class Experts(_Strict):
    """Where the routed experts go (docs/moe.md): the expert-parallel degree, the EP group's
    placement, and the expert class's components over the ranks holding the same experts
    (their mesh: those ranks per node x nodes)."""

    ep: int = Field(ge=1)
    span: bool
    components: dict[Literal["p", "g", "os"], Component]


class Pipeline(_Strict):
    pp: int = Field(ge=2)
    vpp: int = Field(ge=1)
    schedule: Literal["1f1b", "interleaved-1f1b", "gpipe"]


class Decision(_Strict):
    strategy: str
    components: dict[Literal["p", "g", "os"], Component]
    qwz: bool
    quant_block: int
    hpz: int
    qgz: bool
    micro_batch: int
    grad_accum: int
    ckpt: bool | int | Literal["op", "moe"]
    """true: every block; false: none; K: the first K blocks; "op": op-level selective;
    "moe": the MoE layers' MLP parts (version 4)."""
    tp: int = Field(default=1, ge=1)
    """Tensor (+ sequence) parallel degree inside the node (version 3; absent: 1). The
    components' factors and meshes are then over the N/tp data-parallel ranks."""
    experts: Experts | None = None
    """A mixture of experts' routed experts (version 4; absent: no expert tokens)."""
    cp: int = Field(default=1, ge=1)
    """Context-parallel degree (version 5; absent: 1): each sequence split over cp ranks."""
    pipeline: Pipeline | None = None
    """Pipeline stages (version 5; absent: none): the components are then over one stage's
    N/(tp pp) data-parallel ranks."""


class Summary(_Strict):
    strategy: str
    fits: bool
    step_s: float
    memory_bytes: float
    tokens_per_s: float
    mfu: float
    inter_bytes_per_rank_per_step: float
    intra_bytes_per_rank_per_step: float


class SolverInfo(_Strict):
    name: str
    status: str
    objective: str
    num_variables: int = 0
    num_constraints: int = 0
    solves: int = 0


class Volatile(_Strict):
    tool_version: str
    created_at: str
    solve_time_s: float = 0.0
    build_time_s: float = 0.0


class PlanDoc(_Strict):
    """The plan file (JSON). `amsp schema` prints its JSON Schema."""

    format: Literal["amsp-plan"]
    version: int = Field(strict=True)
    inputs: Inputs
    decision: Decision
    predictions: dict[str, Any]
    runners_up: list[Summary]
    baselines: dict[str, Summary]
    solver: SolverInfo
    digest: str
    volatile: Volatile


def json_schema() -> dict:
    s = PlanDoc.model_json_schema()
    s["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    s["$id"] = f"https://amsp-planner/schema/plan-v{VERSION}.json"
    return s


# ----- hashing ------------------------------------------------------------------------------
def canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def sha256(obj: Any) -> str:
    return hashlib.sha256(canonical(obj)).hexdigest()


def content_digest(doc: dict) -> str:
    """The ``digest`` field of a plan document: the SHA-256 of its canonical JSON without
    ``volatile`` and ``digest``."""
    return sha256({k: v for k, v in doc.items() if k not in ("volatile", "digest")})
