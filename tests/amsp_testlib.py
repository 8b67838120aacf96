"""Helpers shared by the tests: a small hand-countable model, jobs on preset clusters, and an
in-process CLI runner. (tests/conftest.py puts this folder on sys.path.)"""

from __future__ import annotations

import contextlib
import io
import json

from amsp_planner.cost.job import Job
from amsp_planner.specs import ModelSpec, TrainingSpec, load_cluster


def small_model(**changes) -> ModelSpec:
    """A 2-block LLaMA-style model whose units are easy to count by hand.

    h = 128, 4 heads (MHA), SwiGLU f = 256, V = 512, untied:
      embedding  V*h                         = 512*128               =  65,536
      block      4h^2 + 3hf + 2h             = 65,536 + 98,304 + 256 = 164,096
      head       h + V*h                     = 128 + 65,536          =  65,664
    """
    fields = dict(name="small", num_layers=2, hidden_size=128, num_heads=4,
                  ffn_hidden_size=256, vocab_size=512, max_seq_len=1024)
    fields.update(changes)
    return ModelSpec(**fields)


def make_job(num_gpus: int, model: ModelSpec | None = None, cluster: str = "dgx-a100-hdr",
             seq_len: int = 128, batch_seqs: int | None = None, **training) -> Job:
    """A Job of `model` (default: small_model) on a preset cluster; batch 2 sequences per GPU."""
    t = TrainingSpec(seq_len=seq_len, global_batch_seqs=batch_seqs or 2 * num_gpus, **training)
    return Job.create(model or small_model(), load_cluster(cluster), t, num_gpus)


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """Run `amsp ARGV` in-process through the real entry point; (exit code, stdout, stderr)."""
    from amsp_planner.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return code, out.getvalue(), err.getvalue()


def assert_user_error(code: int, out: str, err: str, *needles: str) -> str:
    """Exit 2, nothing on stdout, exactly one 'error:' line on stderr containing every needle."""
    assert code == 2, (code, out, err)
    assert "Traceback" not in err and "Traceback" not in out
    lines = err.splitlines()
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith("error: "), line
    for n in needles:
        assert n in line, (n, line)
    return line


NO_TORCH = """
import sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch imported on the planner path")
        return None

sys.meta_path.insert(0, NoTorch())
"""
"""The head of a `python -c` script: a finder that refuses torch, so a script that reaches for
it fails loudly."""


def doc_paths(doc, prefix=()) -> list[tuple]:
    """Every key path of a JSON-like document (mapping keys and list indices), parents first."""
    if isinstance(doc, dict):
        items = doc.items()
    elif isinstance(doc, list):
        items = enumerate(doc)
    else:
        return []
    out = []
    for k, v in items:
        out.append(prefix + (k,))
        out += doc_paths(v, prefix + (k,))
    return out


def get(doc, path):
    for k in path:
        doc = doc[k]
    return doc


def put(doc, path, value):
    """A copy of `doc` with the value at `path` replaced by `value`."""
    doc = json.loads(json.dumps(doc))
    get(doc, path[:-1])[path[-1]] = value
    return doc


@contextlib.contextmanager
def tmpfs(folder, size: str = "2m", read_only: bool = False):
    """A tmpfs of `size` mounted on `folder` (made if missing) for the body, optionally
    read-only: real ENOSPC and EROFS. Skips the test where mounting is not allowed (not root)."""
    import subprocess
    from pathlib import Path

    import pytest

    Path(folder).mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if read_only else "")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(folder)],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or 'not root'})")
    try:
        yield Path(folder)
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def source_has(fn, *needles: str) -> str:
    """Assert that the source of `fn` (an engine's function, read with inspect) contains every
    one of `needles`; returns the source for further checks."""
    import inspect

    src = inspect.getsource(fn)
    for needle in needles:
        assert needle in src, f"{fn.__qualname__}: {needle!r} not in its source"
    return src
