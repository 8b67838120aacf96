"""Checkpoints with torch.distributed.checkpoint (DCP), independent of the plan.

    amsp train plan.json --checkpoint-dir ckpt --checkpoint-every 50 [--resume]

What is saved is plan-free: for each unit, the unpadded fp32 master weights and Adam moments
as one logical 1-D tensor (``unit3.master`` of ``ModelSpec.unit_params()[3]`` elements), each
rank writing the part of its OS shard that is not padding (OS replicas write the same chunk;
DCP keeps one), plus the step, the model and the seed. Any plan of the same model (other
factors, other world size) loads it: DCP reads, for every rank, the saved chunks that overlap
its new OS shard. Parameters are then rebuilt from the masters with the update all-gather
(counted in phase 'checkpoint'); gradients are zero at a step boundary.

Atomic: a checkpoint is written to ``step_K.tmp``, renamed to ``step_K`` once every rank has
finished, and only then does ``latest`` (replaced atomically) point to it; a crash during a
save leaves the previous checkpoint and ``latest`` untouched. The two newest are kept.
DCP's own coordination (plan exchange) uses torch.distributed directly and is not in the
runtime's byte counts; the runtime's collectives around it are.
"""

from __future__ import annotations

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

STATES = ("master", "exp_avg", "exp_avg_sq")
KEEP = 2


class FlatShard:
    """One rank's contiguous chunk [offset, offset + n) of a logical 1-D tensor, for DCP."""

    def __init__(self, tensor: torch.Tensor, offset: int, global_size: int):
        self.tensor, self.offset, self.global_size = tensor, offset, global_size

    def size(self) -> torch.Size:
        return torch.Size([self.global_size])

    def _chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size([self.offset]),
                                    sizes=torch.Size([self.tensor.numel()]))

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        if self.tensor.numel() == 0:
            return []
        return [WriteItem(
            index=MetadataIndex(fqn, torch.Size([self.offset])),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(chunk=self._chunk(),
                                        properties=TensorProperties.create_from_tensor(self.tensor),
                                        size=self.size()),
        )]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk()] if self.tensor.numel() else []


class _SavePlanner(DefaultSavePlanner):
    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict[index.fqn]
        return obj.tensor if isinstance(obj, FlatShard) else super().lookup_object(index)


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
        return obj.tensor if isinstance(obj, FlatShard) else super().lookup_tensor(index)


def _state_dict(engine) -> dict:
    """FlatShards over the engine's own master/moment tensors (no copies)."""
    sd = {}
    for i, lay in enumerate(engine.layouts):
        real = engine.real[i]
        off = lay.os_off(engine.i_os)
        n = max(0, min(lay.os_len, real - off))
        for name in STATES:
            t = getattr(engine, name)[i]
            sd[f"unit{i}.{name}"] = FlatShard(t[:n], min(off, real), real)
    return sd


def _meta(engine) -> str:
    return json.dumps({"step": engine.step_count, "model": engine.job.model.model_dump(),
                       "precision": engine.job.training.precision}, sort_keys=True)


def latest_step(directory: str | os.PathLike) -> int | None:
    p = Path(directory) / "latest"
    if not p.exists():
        return None
    try:
        return int(p.read_text().strip().removeprefix("step_"))
    except ValueError:
        raise AmspUserError(f"--checkpoint-dir: {p} is not a checkpoint pointer: remove it or use "
                            "another directory") from None


def save(engine, directory: str | os.PathLike, step: int) -> Path:
    """Save the engine's state at `step` atomically; returns the checkpoint's directory."""
    root = Path(directory)
    final, tmp = root / f"step_{step}", root / f"step_{step}.tmp"
    rank = dist.get_rank()
    world = engine.groups["world"]
    engine.comm.phase = "checkpoint"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    engine.comm.barrier(world)
    sd = _state_dict(engine)
    sd["meta"] = _meta(engine)
    dcp.save(sd, checkpoint_id=str(tmp), planner=_SavePlanner())
    engine.comm.barrier(world)
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        pointer = root / "latest.tmp"
        pointer.write_text(f"step_{step}\n")
        os.replace(pointer, root / "latest")
        done = sorted(int(p.name[5:]) for p in root.glob("step_*") if p.name[5:].isdigit())
        for old in done[:-KEEP]:
            shutil.rmtree(root / f"step_{old}", ignore_errors=True)
    engine.comm.barrier(world)
    return final


def read_meta(path: str | os.PathLike) -> dict:
    """The step, model and precision a checkpoint was saved with (any process, no group)."""
    head = {"meta": ""}
    dcp.load(head, checkpoint_id=str(path), planner=_LoadPlanner(),
             no_dist=not dist.is_initialized())
    return json.loads(head["meta"])


def load(engine, directory: str | os.PathLike, step: int | None = None) -> int:
    """Load the latest (or given) checkpoint into the engine, under its own plan; returns the
    step it was saved at. Parameters are rebuilt from the loaded masters."""
    step = latest_step(directory) if step is None else step
    if step is None:
        raise AmspUserError(f"--resume: no checkpoint in {directory}: run without --resume first")
    path = Path(directory) / f"step_{step}"
    if not (path / ".metadata").exists():
        raise AmspUserError(f"--resume: {path} is not a complete checkpoint: point --checkpoint-dir "
                            "at a directory written by amsp train")
    meta = read_meta(path)
    if meta.get("model") != json.loads(json.dumps(engine.job.model.model_dump())):
        raise AmspUserError(f"--resume: {path} was written for model "
                            f"'{meta.get('model', {}).get('name')}', the plan trains "
                            f"'{engine.job.model.name}': use a matching plan or another directory")
    sd = _state_dict(engine)
    dcp.load(sd, checkpoint_id=str(path), planner=_LoadPlanner())
    engine.step_count = int(meta["step"])
    engine.comm.phase = "checkpoint"
    for i, lay in enumerate(engine.layouts):
        engine.g_shard[i].zero_()
        work = engine._update_params(i, lay)
        if work is not None:
            work.wait()
    return engine.step_count
