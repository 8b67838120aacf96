"""Checkpoints with torch.distributed.checkpoint (DCP), independent of the plan.

    amsp train plan.json --checkpoint-dir ckpt --checkpoint-every 50 [--resume]

What is saved is plan-free: for each unit, the unpadded fp32 master weights and Adam moments
as one logical 1-D tensor (``unit3.master`` of ``ModelSpec.unit_params()[3]`` elements), each
rank writing the part of its OS shard that is not padding (OS replicas write the same chunk;
DCP keeps one), plus the step, the model and the seed. At tp > 1 a rank's OS shard of its TP
shard is several runs of the logical unit, one chunk each ([Note: TP checkpoints]). Any plan
of the same model (other factors, other world size, other tensor-parallel degree) loads it:
DCP reads, for every rank, the saved chunks that overlap its new OS shard. Parameters are then rebuilt from the masters with the update all-gather
(counted in phase 'checkpoint'); gradients are zero at a step boundary.

Atomic: a checkpoint is written to ``step_K.tmp``, renamed to ``step_K`` once every rank has
finished, and only then does ``latest`` (replaced atomically) point to it; a crash during a
save leaves the previous checkpoint and ``latest`` untouched, and the next save removes the
``.tmp`` folders such a crash left. The two newest are kept.

Verified: every rank hashes the shard files it wrote; ``checksums.json`` (size and SHA-256 of
every shard and of ``.metadata``) is written before the rename. ``verify`` checks a checkpoint
against it before anything reads it, and names the first file that is missing, truncated or
altered. The metadata is read and checked by ``ckpt_meta.py`` (``read_meta``).
DCP's own coordination (plan exchange) uses torch.distributed directly and is not in the
runtime's byte counts; the runtime's collectives around it are.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from amsp_planner.errors import AmspUserError
from amsp_planner.runtime.ckpt_files import (  # noqa: F401 - this module's API too
    METADATA,
    STATES,
    SUMS,
    check_model,
    complete_steps,
    file_kind_problem,
    latest_step,
    resume_step,
    verify,
)
from amsp_planner.runtime.ckpt_meta import read_meta

KEEP = 2


class FlatShard:
    """One rank's chunks of a logical 1-D tensor, for DCP: ``pieces`` of (tensor, offset), each
    the contiguous elements [offset, offset + n) (one piece at tp = 1; at tp > 1 a TP shard's
    elements lie in several runs of the logical unit)."""

    def __init__(self, pieces: list[tuple[torch.Tensor, int]], global_size: int):
        self.pieces = [(t, o) for t, o in pieces if t.numel()]
        self.global_size = global_size
        self._by_offset = {o: t for t, o in self.pieces}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t, _ in self.pieces)

    def size(self) -> torch.Size:
        return torch.Size([self.global_size])

    @staticmethod
    def _chunk(t: torch.Tensor, o: int) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size([o]), sizes=torch.Size([t.numel()]))

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        return [WriteItem(
            index=MetadataIndex(fqn, torch.Size([o])),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(chunk=self._chunk(t, o),
                                        properties=TensorProperties.create_from_tensor(t),
                                        size=self.size()),
        ) for t, o in self.pieces]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk(t, o) for t, o in self.pieces]

    def lookup(self, index: MetadataIndex) -> torch.Tensor:
        """The piece a save's write item or a load's read item (by its chunk's place) names."""
        if index.index is not None and index.index < len(self.pieces):
            t, o = self.pieces[index.index]
            if torch.Size([o]) == index.offset:
                return t
        return self._by_offset[index.offset[0]]


class _SavePlanner(DefaultSavePlanner):
    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict[index.fqn]
        return obj.lookup(index) if isinstance(obj, FlatShard) else super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        # the default set-up maps unknown objects to None: keep the FlatShards aside
        shards = {k: v for k, v in state_dict.items() if isinstance(v, FlatShard)}
        rest = {k: v for k, v in state_dict.items() if k not in shards}
        super().set_up_planner(rest, metadata, is_coordinator)
        self.original_state_dict = state_dict  # loaded bytes land in the caller's dict
        self.state_dict.update(shards)
        self.mappings.update({k: (k,) for k in shards})

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return obj.lookup(index) if isinstance(obj, FlatShard) else super().lookup_tensor(index)


def _tp_runs(engine, i: int, off: int, n: int, saving: bool) -> list[tuple[int, int, int]]:
    """[Note: TP checkpoints] (start in the OS shard, logical offset, length) of the runs of
    elements [off, off + n) of this TP rank's unit i that are consecutive in the logical unit.
    A save leaves the replicated weights (the norms) to TP rank 0, so no two ranks write
    overlapping chunks (DP replicas of one OS shard write identical ones, which DCP keeps once)."""
    from amsp_planner.runtime.tp import shard_index

    idx = shard_index(engine.job.model, i, engine.tp, engine.tp_rank)[off:off + n]
    pos = torch.arange(n)
    if saving and engine.tp_rank:
        keep = torch.ones(n, dtype=torch.bool)
        for a, b in engine._replicated_in_os(i):
            keep[a:b] = False
        pos, idx = pos[keep], idx[keep]
    if not len(pos):
        return []
    brk = ((pos[1:] - pos[:-1] != 1) | (idx[1:] - idx[:-1] != 1)).nonzero().flatten() + 1
    starts = [0] + brk.tolist()
    ends = brk.tolist() + [len(pos)]
    p, g = pos.tolist(), idx.tolist()
    return [(p[a], g[a], b - a) for a, b in zip(starts, ends, strict=True)]


def _state_dict(engine, saving: bool = False) -> dict:
    """FlatShards over the engine's own master/moment tensors (no copies): each rank's OS
    shard, less its padding, in the logical (t = 1) unit's element order.

    [Note: MoE checkpoints] A MoE block whose experts are a class of their own (experts.py)
    is still one logical tensor per state: its dense part is the logical unit's first
    elements (the routed experts are its last parameter), and the rank's OS shard of its
    expert unit (E/e experts) is one more piece at those experts' logical offset. So a
    checkpoint saved at one EP degree and expert triple loads at any other, as across dense
    factors."""
    sd = {}
    for i, lay in enumerate(engine.layouts):
        real = engine.real[i]
        off = lay.os_off(engine.i_os)
        n = max(0, min(lay.os_len, real - off))
        logical = engine.job.model.unit_params()[i]
        runs = [(0, min(off, real), n)] if engine.tp == 1 else _tp_runs(engine, i, off, n, saving)
        k_x = engine.x_of.get(i) if engine.tp == 1 else None
        for name in STATES:
            t = getattr(engine, name)[i]
            pieces = [(t[a:a + k], g) for a, g, k in runs]
            if k_x is not None:  # [Note: MoE checkpoints]
                pieces += engine.xp.os_pieces(k_x, name)
            sd[f"unit{i}.{name}"] = FlatShard(pieces, logical)
    return sd


def _meta(engine) -> str:
    return json.dumps({"step": engine.step_count, "model": engine.job.model.model_dump(),
                       "precision": engine.job.training.precision}, sort_keys=True)


def save(engine, directory: str | os.PathLike, step: int, die=None) -> Path:
    """Save the engine's state at `step` atomically; returns the checkpoint's directory.
    `die`: a testing aid called once this rank's shards are written (a crash mid-save)."""
    from amsp_planner.runtime import faults

    root = Path(directory)
    final, tmp = root / f"step_{step}", root / f"step_{step}.tmp"
    rank = dist.get_rank()
    world = engine.groups["world"]
    engine.comm.phase = "checkpoint"
    faults.at(doing=f"saving checkpoint step_{step} in {root}")
    if rank == 0:
        from amsp_planner.runtime.ckpt_lock import folder_problem

        gone = folder_problem(root)  # the launch created and locked it
        if gone:
            raise faults.RunFault(gone)
        root.mkdir(parents=True, exist_ok=True)  # no lock taken: the runtime called directly
        for stale in root.glob("step_*.tmp"):  # this save's, or an earlier crash's
            shutil.rmtree(stale, ignore_errors=True)
    engine.comm.barrier(world)
    sd = _state_dict(engine, saving=True)
    sd["meta"] = _meta(engine)
    try:
        dcp.save(sd, checkpoint_id=str(tmp), planner=_SavePlanner())
    except BaseException as e:
        _raise_if_full(root, sd, step, e)
        raise
    _write_json(tmp / f".sums_{rank}.json", _digests(tmp, f"__{rank}_*.distcp"))
    if die is not None:
        die()
    engine.comm.barrier(world)
    if rank == 0:
        sums = _digests(tmp, ".metadata")
        for part in tmp.glob(".sums_*.json"):
            sums.update(json.loads(part.read_text()))
            part.unlink()
        _write_json(tmp / SUMS, sums)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _write_json(root / "latest", None, text=f"step_{step}\n")
        _rotate(root, step)
    engine.comm.barrier(world)
    return final


def _rotate(root: Path, step: int) -> None:
    """Remove the complete checkpoints older than the KEEP newest: each is first renamed to
    a ``.tmp`` name (atomic; the next save removes such leftovers), so a process stopped
    while removing leaves no half-deleted checkpoint that looks complete. A rank that lost
    its launcher removes none (``lifecycle.orphaned``): it is being stopped."""
    from amsp_planner.runtime.lifecycle import orphaned

    if orphaned():
        return
    for old in complete_steps(root)[:-KEEP]:
        doomed = root / f"step_{old}.del-{os.getpid()}.tmp"
        try:
            os.replace(root / f"step_{old}", doomed)
        except OSError:
            continue
        shutil.rmtree(doomed, ignore_errors=True)


def _raise_if_full(root: Path, sd: dict, step: int, exc: BaseException) -> None:
    """A full disk shows in DCP as torch's zip writer failing ("unexpected pos"): name it
    when the folder has less room than this rank's shards."""
    from amsp_planner.report.fmt import bytes_h
    from amsp_planner.runtime.faults import RunFault

    need = sum(v.nbytes for v in sd.values() if isinstance(v, FlatShard))
    free = shutil.disk_usage(root).free
    if free < need:
        raise RunFault(f"no space left on device while saving checkpoint step_{step} in {root} "
                       f"({bytes_h(free)} free, this rank writes {bytes_h(need)})") from exc


def _write_json(path: Path, doc, text: str | None = None) -> None:
    """Write a small file atomically (a temporary name, then a rename)."""
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(text if text is not None else json.dumps(doc, sort_keys=True, indent=1))
    os.replace(tmp, path)


def _digests(folder: Path, pattern: str) -> dict[str, list]:
    """{file name: [size, sha256]} of the files of `folder` matching `pattern`."""
    out = {}
    for p in sorted(folder.glob(pattern)):
        with open(p, "rb") as f:
            out[p.name] = [p.stat().st_size, hashlib.file_digest(f, "sha256").hexdigest()]
    return out




def load(engine, directory: str | os.PathLike, step: int | None = None,
         verified: bool = False) -> int:
    """Load the latest (or given) checkpoint into the engine, under its own plan; returns the
    step it was saved at. Parameters are rebuilt from the loaded masters. Unless the launcher
    `verified` it already, rank 0 checks the checksums first and every rank refuses alike."""
    from amsp_planner.runtime import faults

    step = resume_step(directory, step)
    if step is None:
        raise AmspUserError(f"--resume: no checkpoint in {directory}: run without --resume first")
    path = Path(directory) / f"step_{step}"
    faults.at(doing=f"loading checkpoint step_{step} from {directory}")
    if not verified:
        _agree(lambda: verify(path))
    meta = read_meta(path)
    check_model(meta, engine.job, directory)
    sd = _state_dict(engine)
    dcp.load(sd, checkpoint_id=str(path), planner=_LoadPlanner())
    engine.comm.phase = "checkpoint"
    for c in engine.classes():
        c.step_count = int(meta["step"])
        for i, lay in enumerate(c.layouts):
            c.g_shard[i].zero_()
            work = c._update_params(i, lay)
            if work is not None:
                work.wait()
    return engine.step_count


def _agree(check) -> None:
    """Run `check` on rank 0; every rank raises its refusal (one uncounted broadcast, like
    DCP's own coordination)."""
    msg = [None]
    if dist.get_rank() == 0:
        try:
            check()
        except AmspUserError as e:
            msg[0] = str(e)
    dist.broadcast_object_list(msg, src=0)
    if msg[0]:
        raise AmspUserError(msg[0])
