"""The run's inputs checked before launch, as bad input (one line naming the option, exit 2):
the token file, the seed, the learning rate, the rendezvous port. Imports no torch.

- ``--data FILE``: a regular file (never a folder, FIFO or device: a FIFO would hang every
  rank), readable, a whole number of tokens, at least one sequence of ``seq_len + 1`` tokens,
  every token id (of the first ``TOKEN_SCAN`` tokens) below the model's vocabulary;
- ``--seed``: ``0 .. SEED_MAX`` (torch's generators take 64-bit seeds; the data order's
  generator is seeded with ``seed * 1,000,003 + step``, which must stay below 2**63);
- ``--lr``: finite, in ``(0, LR_MAX]`` (AdamW's step is lr-sized per element: above 1 a
  step moves a weight more than any weight's scale);
- ``--master-port``: free on this host when this host is the master (one node, node 0, or
  ``--local-nodes``).
"""

from __future__ import annotations

import errno
import math
import os
import socket
import stat
from pathlib import Path

from amsp_planner.errors import AmspUserError

SEED_MAX = 2**32 - 1
LR_MAX = 1.0
TOKEN_SCAN = 2**22
"""Tokens of a data file whose ids are checked before launch (the ranks check the same)."""
_FIX = "give a token file (uint16 .bin, or .u32 for uint32), 'stdlib' or 'synthetic'"


def token_dtype(path: str | os.PathLike) -> str:
    return "uint32" if Path(path).suffix in (".u32", ".uint32") else "uint16"


def check_data(spec: str | None, vocab_size: int, seq_len: int) -> None:
    """Refuse a ``--data`` file the ranks could not read as tokens (before launch)."""
    if spec is None or spec in ("synthetic", "stdlib"):
        return
    import numpy as np

    if not spec.strip():
        raise AmspUserError(f"--data is empty: {_FIX}")
    p = Path(spec)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise AmspUserError(f"--data {spec}: does not exist: {_FIX}") from None
    except OSError as e:
        raise AmspUserError(f"--data {spec}: {(e.strerror or str(e)).lower()}: {_FIX}") from None
    if not stat.S_ISREG(st.st_mode):
        from amsp_planner.runtime.ckpt_files import kind_of

        raise AmspUserError(f"--data {spec}: is {kind_of(st.st_mode)}, not a token file: {_FIX}")
    if not os.access(p, os.R_OK):
        raise AmspUserError(f"--data {spec}: permission denied: make it readable or {_FIX}")
    dtype = np.dtype(token_dtype(p))
    if st.st_size % dtype.itemsize:
        raise AmspUserError(f"--data {spec}: is not a whole number of {dtype.name} tokens "
                            f"({st.st_size:,} bytes): check the file")
    n = st.st_size // dtype.itemsize
    if n < seq_len + 2:
        raise AmspUserError(f"--data {spec}: holds {n:,} tokens, fewer than one sequence of "
                            f"{seq_len + 1} and its target: use a longer file or a shorter "
                            "--seq-len")
    try:  # a file the kernel serves but cannot map (sysfs, procfs) fails here
        tokens = np.memmap(p, dtype=dtype, mode="r", shape=(n,))
        top = int(tokens[:min(n, TOKEN_SCAN)].max())
    except (OSError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise AmspUserError(f"--data {spec}: cannot read it as tokens ({why}): {_FIX}") from None
    if top >= vocab_size:
        raise AmspUserError(f"--data {spec}: token id {top} is not below the model's vocab_size "
                            f"{vocab_size}: use a matching tokenizer or model")


def check_seed(seed: int) -> None:
    if not 0 <= seed <= SEED_MAX:
        raise AmspUserError(f"--seed {seed}: out of range: give 0 .. {SEED_MAX}")


def check_lr(lr: float) -> None:
    if not (math.isfinite(lr) and 0 < lr <= LR_MAX):
        raise AmspUserError(f"--lr {lr:g}: out of range: give a finite learning rate in "
                            f"(0, {LR_MAX:g}] (e.g. 1e-3)")


def check_port(port: int, addr: str = "") -> None:
    """Refuse a rendezvous port another process listens on here (torchrun's store would fail
    to bind it, or join the other job's)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a listener refuses; TIME_WAIT not
        try:
            s.bind((addr, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise AmspUserError(f"--master-port {port}: in use on this host: choose a free "
                                    "port, or drop the option to take one") from None
            raise AmspUserError(f"--master-port {port}: cannot be bound here "
                                f"({(e.strerror or str(e)).lower()}): choose another port"
                                ) from None
