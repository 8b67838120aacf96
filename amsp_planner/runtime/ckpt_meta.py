"""Reading a checkpoint's DCP metadata safely: ``read_meta`` returns the step, model and
precision a checkpoint was saved with and its tensors' sizes, any process, no group.

The ``.metadata`` pickle is unpickled with only DCP's own metadata classes allowed (anything
else refused unrun), after its file's kind and size are checked; the tensors' chunks must tile
each tensor and their storage must lie inside the folder's files, which the storage entries tile
exactly. A damaged one is refused in one line naming the fix. ``checkpoint.py`` (save and load)
re-exports ``read_meta``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
from pathlib import Path

import torch

from amsp_planner.errors import AmspUserError
from amsp_planner.runtime.ckpt_files import METADATA, file_kind_problem

METADATA_MAX = 256 * 2**20
"""Bytes of a ``.metadata`` (a few KiB per rank and unit; far above any job's)."""


_PICKLED = {("torch.distributed.checkpoint.metadata", n) for n in (
    "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
    "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath")}
"""What a DCP ``.metadata`` pickle may name (torch 2.13); anything else is refused unrun."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _PICKLED or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"names {module}.{name}")


class _Damaged(Exception):
    """What is wrong with a checkpoint's metadata (read_meta turns it into one line)."""


def _chunks_tile(fqn: str, tm, n: int) -> None:
    """The saved chunks of a 1-D tensor of `n` elements cover [0, n) exactly (replicas'
    identical chunks are kept once by DCP)."""
    spans = sorted({(c.offsets[0], c.sizes[0]) for c in tm.chunks
                    if len(c.offsets) == 1 and len(c.sizes) == 1})
    if len(spans) != len(tm.chunks):
        raise _Damaged(f"tensor {fqn} has malformed chunks")
    end = 0
    for o, k in spans:
        if o != end or k <= 0:
            raise _Damaged(f"tensor {fqn}'s chunks do not tile its {n:,} elements "
                           f"(a chunk at {o:,} of {k:,})")
        end = o + k
    if end != n:
        raise _Damaged(f"tensor {fqn}'s chunks cover {end:,} of its {n:,} elements")


def _storage(md, fqn: str, offset, path: Path, min_len: int):
    """The (file, offset, length) a chunk is stored at, within a regular file of the folder."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    info = md.storage_data.get(MetadataIndex(fqn, offset))
    name = getattr(info, "relative_path", None)
    if not isinstance(name, str) or "/" in name or name.startswith("."):
        raise _Damaged(f"tensor {fqn} has no valid storage entry")
    f = path / name
    bad = file_kind_problem(f)
    if bad:
        raise _Damaged(f"tensor {fqn} is stored in {name}, which {bad.replace('is ', '', 1)}"
                       if bad != "missing" else f"tensor {fqn} is stored in {name}, missing")
    o, k = info.offset, info.length
    if not (type(o) is int and type(k) is int and o >= 0 and k >= min_len
            and o + k <= f.stat().st_size):
        raise _Damaged(f"tensor {fqn}'s storage ({name} at {o}, {k} bytes) lies outside the "
                       "file")
    return f, o, k


def _files_tiled(spans: list[tuple[Path, int, int]], entries: int) -> None:
    """DCP writes a rank's items back to back: the storage entries of each file tile it
    exactly, and there is no entry besides the tensors' and the run record's."""
    if len(set(spans)) != entries:
        raise _Damaged(f"lists {entries} storage entries for {len(set(spans))} stored items")
    by_file: dict[Path, list[tuple[int, int]]] = {}
    for f, o, k in set(spans):
        by_file.setdefault(f, []).append((o, k))
    for f, items in by_file.items():
        end = 0
        for o, k in sorted(items):
            if o != end:
                raise _Damaged(f"storage entries of {f.name} do not tile it (a gap or an overlap "
                               f"at byte {min(o, end):,})")
            end = o + k
        if end != f.stat().st_size:
            raise _Damaged(f"storage entries of {f.name} cover {end:,} of its "
                           f"{f.stat().st_size:,} bytes")


def _metadata(path: Path) -> tuple[dict, dict[str, int]]:
    """The checkpoint's meta (step, model, precision) and its tensors' sizes, read without
    running anything of the pickle but DCP's own metadata classes."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        Metadata,
        TensorStorageMetadata,
    )

    f = path / METADATA
    bad = file_kind_problem(f, METADATA_MAX)
    if bad:
        raise _Damaged(bad)
    try:  # from memory: a damaged length asks for no more than the file holds; a damaged
        # bytearray makes CPython print a SystemError of its own, kept off the terminal
        with contextlib.redirect_stderr(io.StringIO()):
            md = _MetadataUnpickler(io.BytesIO(f.read_bytes())).load()
    except Exception as e:  # noqa: BLE001 - any damage of the pickle is one line
        why = " ".join(str(e).split())[:80]  # the pickle's message may span lines
        raise _Damaged(f"cannot be read ({type(e).__name__}: {why})") from None
    sdm = getattr(md, "state_dict_metadata", None)
    if not isinstance(md, Metadata) or not isinstance(sdm, dict) or not isinstance(
            md.storage_data, dict):
        raise _Damaged("is not a DCP metadata table")
    if not isinstance(sdm.get("meta"), BytesStorageMetadata):
        raise _Damaged("has no run record (meta)")
    sizes, spans = {}, []
    for fqn, tm in sdm.items():
        if fqn == "meta":
            continue
        if not (isinstance(tm, TensorStorageMetadata) and len(tm.size) == 1
                and tm.properties.dtype == torch.float32):
            raise _Damaged(f"entry {str(fqn)[:60]} is not a 1-D fp32 tensor")
        n = tm.size[0]
        _chunks_tile(fqn, tm, n)
        for c in tm.chunks:
            spans.append(_storage(md, fqn, c.offsets, path, 4 * c.sizes[0]))
        sizes[fqn] = n
    spans.append(_storage(md, "meta", None, path, 1))
    _files_tiled(spans, len(md.storage_data))
    f, o, k = spans[-1]
    with open(f, "rb") as fh:
        fh.seek(o)
        blob = fh.read(k)
    try:
        meta = json.loads(torch.load(io.BytesIO(blob), weights_only=True))
    except Exception as e:  # noqa: BLE001
        raise _Damaged(f"its run record cannot be read ({type(e).__name__})") from None
    if not (isinstance(meta, dict) and type(meta.get("step")) is int and meta["step"] >= 0):
        raise _Damaged("its run record has no step")
    return meta, sizes


def read_meta(path: str | os.PathLike) -> dict:
    """The step, model and precision a checkpoint was saved with, and under ``_sizes`` its
    tensors' element counts (any process, no group). The metadata is checked for its kind,
    the classes its pickle names, the tensors' chunks tiling each tensor and their storage
    lying inside the folder's files; a damaged one is refused in one line."""
    path = Path(path)
    try:
        meta, sizes = _metadata(path)
    except _Damaged as e:
        raise AmspUserError(f"--resume: checkpoint {path.name}: {METADATA} {e}: remove {path} "
                            "or resume another with --resume-from K") from None
    return {**meta, "_sizes": sizes}
