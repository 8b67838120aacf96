"""Token sources: synthetic, a nanoGPT-style token file, or a small real corpus from the
Python standard library (byte-level, vocabulary 256).

Every batch is a pure function of (seed, step), so a resumed run sees the same data and every
plan sees the same global batch: rank r takes sequences [r*b, (r+1)*b) of it (b per rank), cut
into micro-batches in order.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import numpy as np
import torch

from amsp_planner.errors import AmspUserError
from amsp_planner.runtime.inputs import check_data, token_dtype

STDLIB = "stdlib"
STDLIB_BYTES = 4 * 2**20


def stdlib_corpus(max_bytes: int = STDLIB_BYTES) -> np.ndarray:
    """The first `max_bytes` of the standard library's .py files (sorted), as uint8 tokens."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)


class TokenSource:
    """Global batches of `batch_seqs` sequences of `seq_len + 1` tokens."""

    def __init__(self, spec: str | None, vocab_size: int, seq_len: int, batch_seqs: int,
                 seed: int = 0):
        self.vocab, self.seq_len, self.batch_seqs, self.seed = vocab_size, seq_len, batch_seqs, seed
        self.tokens: np.ndarray | None = None
        self.name = spec or "synthetic"
        if spec is None or spec == "synthetic":
            return
        if spec == STDLIB:
            self.tokens = stdlib_corpus()
        else:
            check_data(spec, vocab_size, seq_len)  # kind, size, shape: refused before reading
            self.tokens = np.memmap(spec, dtype=token_dtype(spec), mode="r")
            self._size = os.stat(spec).st_size
        n = len(self.tokens)
        if n < seq_len + 2:
            raise AmspUserError(f"--data: {spec} holds {n} tokens, fewer than one sequence of "
                                f"{seq_len + 1}: use a longer file or a shorter --seq-len")
        top = int(self.tokens[: min(n, 2**22)].max())
        if top >= vocab_size:
            raise AmspUserError(f"--data: token id {top} in {spec} is not below the model's "
                                f"vocab_size {vocab_size}: use a matching tokenizer or model")

    def batch(self, step: int, rows: slice | None = None) -> torch.Tensor:
        """int64 tokens [rows, seq_len + 1] of global batch `step`."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        shape = (self.batch_seqs, self.seq_len + 1)
        if self.tokens is None:
            out = torch.randint(self.vocab, shape, generator=g)
            return out if rows is None else out[rows]
        starts = torch.randint(len(self.tokens) - self.seq_len - 1, (self.batch_seqs,), generator=g)
        idx = range(self.batch_seqs)[rows] if rows is not None else range(self.batch_seqs)
        self._unchanged()
        seqs = [np.asarray(self.tokens[int(starts[i]):int(starts[i]) + self.seq_len + 1],
                           dtype=np.int64) for i in idx]
        out = np.stack(seqs)
        top = int(out.max())
        if top >= self.vocab:  # past the first 2**22 tokens checked before the run
            from amsp_planner.runtime.faults import RunFault

            raise RunFault(f"--data {self.name}: token id {top} (batch of step {step + 1}) is "
                           f"not below the model's vocab_size {self.vocab}: use a matching "
                           "tokenizer or model")
        return torch.from_numpy(out)

    def _unchanged(self) -> None:
        """The token file is the size it was when mapped (a file cut short under the mapping
        would end the rank with SIGBUS, no cause named)."""
        if self.name == STDLIB or self.tokens is None:
            return
        try:
            size = os.stat(self.name).st_size
            now = f"{size:,} bytes"
        except OSError as e:
            size, now = None, f"unreadable ({(e.strerror or str(e)).lower()})"
        if size != self._size:
            from amsp_planner.runtime.faults import RunFault

            raise RunFault(f"--data {self.name} changed during the run: {self._size:,} bytes "
                           f"when it started, now {now}: keep the token file as it is while "
                           "a job reads it")
