"""Damaged checkpoints and bad run inputs are refused before launch in one line naming the
file or the option (exit 2): never a traceback, a hang or a silent success.

One real checkpoint (a 1-rank run of the tiny model, 2 steps) is damaged in every way a
shared file system, a script or a user produces: its ``checksums.json`` as any JSON (a
family, property-based), as a FIFO, a folder, a link to /dev/zero or too big; a shard or
``.metadata`` that is not a regular file; ``latest`` as a folder or any bytes; every single-bit
flip of ``.metadata`` with its checksum rewritten (as a script that rewrites the table
would). The run inputs: ``--data`` files of any kind and content, seeds, learning rates, a
busy port.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")

from amsp_planner.errors import AmspUserError  # noqa: E402
from amsp_planner.runtime.ckpt_files import SUMS, latest_step, verify  # noqa: E402

from .mp import amsp, make_plan, one_error_line  # noqa: E402

FAST = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


@contextlib.contextmanager
def no_hang(seconds: int = 20):
    """Fail instead of hanging (a FIFO opened for reading blocks forever)."""
    def boom(*_):
        raise AssertionError(f"hung for {seconds} s")

    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A real checkpoint: step_2 of a 1-rank run in this process; the plan and its job."""
    import torch.distributed as dist

    from amsp_planner.plan import load_plan
    from amsp_planner.runtime.train import RunConfig, train

    tmp = tmp_path_factory.mktemp("ck")
    plan = make_plan(tmp, "p1.json", 1)
    p = load_plan(plan)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        train(p.job, p.strategy, RunConfig(steps=2, checkpoint_dir=str(tmp / "ck"),
                                           checkpoint_every=2, log_every=0), p.evaluation)
    finally:
        dist.destroy_process_group()
    return {"dir": tmp, "plan": plan, "ck": tmp / "ck", "job": p.job}


@pytest.fixture
def ck(ckpt, tmp_path):
    """A fresh copy of the checkpoint folder to damage."""
    dst = tmp_path / "ck"
    shutil.copytree(ckpt["ck"], dst, symlinks=True)
    return dst


def _refused(fn, *needles) -> str:
    with no_hang(), pytest.raises(AmspUserError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in needles), msg
    return msg


# ----- checksums.json ------------------------------------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                max_size=4),
    max_leaves=16)


@FAST
@given(doc=json_values)
@example(doc={})
@example(doc=[])
@example(doc={".metadata": 5})
@example(doc={".metadata": [12, "ab"], "__0_0.distcp": [1, 2]})
@example(doc={"/dev/zero": [0, "0" * 64]})
@example(doc={"../../etc/passwd": [0, "0" * 64]})
@example(doc={".metadata": [True, "0" * 64]})
def test_any_checksum_table_but_the_true_one_is_refused(ck, doc):
    step = ck / "step_2"
    (step / SUMS).write_text(json.dumps(doc))
    _refused(lambda: verify(step), "--resume: checkpoint step_2:")


def test_a_checksum_table_nested_100000_deep_is_refused(ck):
    step = ck / "step_2"
    (step / SUMS).write_text("[" * 100_000 + "]" * 100_000)
    _refused(lambda: verify(step), f"{SUMS} is unreadable")


def test_a_table_missing_a_shard_is_refused(ck):
    step = ck / "step_2"
    sums = json.loads((step / SUMS).read_text())
    shard = next(k for k in sums if k.endswith(".distcp"))
    del sums[shard]
    (step / SUMS).write_text(json.dumps(sums))
    _refused(lambda: verify(step), f"shard {shard} is not in {SUMS}")


def _fifo(p: Path) -> None:
    p.unlink(missing_ok=True)
    os.mkfifo(p)


def _folder(p: Path) -> None:
    p.unlink(missing_ok=True)
    p.mkdir()


def _dev_zero(p: Path) -> None:
    p.unlink(missing_ok=True)
    p.symlink_to("/dev/zero")


KINDS = {"a FIFO": _fifo, "a folder": _folder, "a device": _dev_zero}


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("name", [SUMS, ".metadata", "__0_0.distcp"])
def test_a_checkpoint_file_that_is_not_a_regular_file_is_refused_unread(ck, name, kind):
    step = ck / "step_2"
    if name != SUMS:  # the table names it with a size a FIFO or device has: 0
        sums = json.loads((step / SUMS).read_text())
        sums[name][0] = 0
        (step / SUMS).write_text(json.dumps(sums))
    KINDS[kind](step / name)
    _refused(lambda: verify(step), f"{name} is {kind}, not a regular file")


def test_a_huge_checksum_table_is_refused_unread(ck):
    f = ck / "step_2" / SUMS
    with open(f, "r+b") as fh:
        fh.truncate(64 * 2**20)  # sparse: no disk used
    _refused(lambda: verify(ck / "step_2"), "more than the 16,777,216 such a file can be")


# ----- latest ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_latest_that_is_not_a_regular_file_is_refused(ck, kind):
    KINDS[kind](ck / "latest")
    _refused(lambda: latest_step(ck), f"{ck}/latest is {kind}, not a regular file")


@FAST
@given(text=st.binary(max_size=80))
@example(text=b"step_2\n")
@example(text=b"step_-1\n")
@example(text=b"step_2\nstep_4\n")
def test_latest_is_a_step_pointer_or_refused(ck, text):
    (ck / "latest").write_bytes(text)
    try:
        k = latest_step(ck)
    except AmspUserError as e:
        assert "\n" not in str(e) and str(ck / "latest") in str(e)
        return
    assert text.decode().rstrip("\n") == f"step_{k}" and k >= 0


# ----- .metadata: every bit flip, its checksum rewritten ------------------------------------
def _rewrite_sum(step: Path, name: str) -> None:
    sums = json.loads((step / SUMS).read_text())
    data = (step / name).read_bytes()
    sums[name] = [len(data), hashlib.sha256(data).hexdigest()]
    (step / SUMS).write_text(json.dumps(sums))


@FAST
@given(where=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
@example(where=0.5, bit=0)
def test_a_bit_flipped_metadata_is_refused_or_reads_the_same(ckpt, ck, capfd, where, bit):
    """A flip that changes what the checkpoint holds (classes, tensors, sizes, chunks, where
    they are stored) is refused in one line; the others (an id, a path) read the same."""
    from amsp_planner.runtime.preflight import check_resume

    step = ck / "step_2"
    f = step / ".metadata"
    data = bytearray(f.read_bytes())
    pos = int(where * len(data))
    data[pos] ^= 1 << bit
    f.write_bytes(bytes(data))
    _rewrite_sum(step, ".metadata")
    opts = {"checkpoint_dir": str(ck), "resume": True, "steps": 4}
    try:
        with no_hang():
            check_resume(ckpt["job"], opts)
    except AmspUserError as e:
        assert "\n" not in str(e) and "checkpoint step_2: .metadata" in str(e)
    else:
        from amsp_planner.runtime.checkpoint import read_meta

        sizes = ckpt["job"].model.unit_params()
        assert read_meta(step)["_sizes"] == {f"unit{i}.{s}": n for i, n in enumerate(sizes)
                                             for s in ("master", "exp_avg", "exp_avg_sq")}
    out, err = capfd.readouterr()
    assert err == "", err[-2000:]  # no traceback printed along the way


# ----- run inputs -------------------------------------------------------------------------------
def _data_kinds(tmp: Path) -> dict[str, tuple[str, str]]:
    (tmp / "empty.bin").write_bytes(b"")
    (tmp / "odd.bin").write_bytes(b"\x01\x00\x02")
    (tmp / "short.bin").write_bytes(b"\x01\x00" * 10)
    (tmp / "high.bin").write_bytes(b"\xff\xff" * 100)
    (tmp / "dir").mkdir(exist_ok=True)
    if not (tmp / "fifo").exists():
        os.mkfifo(tmp / "fifo")
    return {"empty": (str(tmp / "empty.bin"), "holds 0 tokens"),
            "folder": (str(tmp / "dir"), "is a folder, not a token file"),
            "fifo": (str(tmp / "fifo"), "is a FIFO, not a token file"),
            "device": ("/dev/zero", "is a device, not a token file"),
            "odd": (str(tmp / "odd.bin"), "is not a whole number of uint16 tokens (3 bytes)"),
            "short": (str(tmp / "short.bin"), "holds 10 tokens, fewer than one sequence"),
            "high": (str(tmp / "high.bin"), "token id 65535 is not below"),
            "missing": (str(tmp / "nope.bin"), "does not exist")}


@pytest.mark.parametrize("kind", ["empty", "folder", "fifo", "device", "odd", "short", "high",
                                  "missing"])
def test_a_bad_data_file_is_refused_unread(tmp_path, kind):
    from amsp_planner.runtime.inputs import check_data

    path, why = _data_kinds(tmp_path)[kind]
    _refused(lambda: check_data(path, 256, 32), f"--data {path}: {why}")


@FAST
@given(content=st.binary(max_size=200), suffix=st.sampled_from([".bin", ".u32"]))
def test_any_data_file_is_tokens_or_refused(tmp_path, content, suffix):
    import numpy as np

    from amsp_planner.runtime.inputs import check_data

    f = tmp_path / f"d{suffix}"
    f.write_bytes(content)
    try:
        check_data(str(f), 256, 16)
    except AmspUserError as e:
        assert str(e).startswith(f"--data {f}: ") and "\n" not in str(e)
        return
    tokens = np.frombuffer(content, dtype=np.uint32 if suffix == ".u32" else np.uint16)
    assert len(tokens) >= 18 and tokens.max() < 256


@given(seed=st.integers(-2**70, 2**70))
@example(seed=2**64)
@example(seed=2**32)
def test_seed_in_its_range_or_refused(seed):
    from amsp_planner.runtime.inputs import SEED_MAX, check_seed

    if 0 <= seed <= SEED_MAX:
        check_seed(seed)
    else:
        _refused(lambda: check_seed(seed), f"--seed {seed}: out of range: give 0 .. {SEED_MAX}")


@given(lr=st.floats(allow_nan=True, allow_infinity=True))
@example(lr=1e38)
@example(lr=float("nan"))
@example(lr=float("inf"))
@example(lr=0.0)
def test_lr_finite_in_its_range_or_refused(lr):
    from amsp_planner.runtime.inputs import check_lr

    if 0 < lr <= 1:
        check_lr(lr)
    else:
        _refused(lambda: check_lr(lr), "--lr", "out of range: give a finite learning rate in "
                                              "(0, 1]")


def test_a_busy_port_is_refused():
    from amsp_planner.runtime.inputs import check_port

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        _refused(lambda: check_port(port), f"--master-port {port}: in use on this host")


# ----- the CLI: before launch, one line, exit 2 ------------------------------------------------
@pytest.mark.parametrize("args,starts", [
    (["--data", "{fifo}"], "--data {fifo}: is a FIFO"),
    (["--data", "/dev/zero"], "--data /dev/zero: is a device"),
    (["--data", "{empty}"], "--data {empty}: holds 0 tokens"),
    (["--seed", str(2**64)], f"--seed {2**64}: out of range"),
    (["--lr", "1e38"], "--lr 1e+38: out of range"),
    (["--lr", "nan"], "--lr nan: out of range"),
    (["--master-port", "{port}"], "--master-port {port}: in use on this host"),
    (["--save-on-sigterm"], "--save-on-sigterm: needs --checkpoint-dir DIR"),
])
def test_bad_run_inputs_are_refused_before_launch(ckpt, tmp_path, args, starts):
    kinds = _data_kinds(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        values = {"fifo": kinds["fifo"][0], "empty": kinds["empty"][0],
                  "port": s.getsockname()[1]}
        args = [a.format(**values) for a in args]
        r = amsp("train", ckpt["plan"], "--steps", 2, *args, cwd=tmp_path, timeout=60)
    one_error_line(r, starts.format(**values))


def test_a_second_lock_on_a_folder_is_refused_naming_the_holder(tmp_path):
    from amsp_planner.runtime.ckpt_lock import lock_folder, release

    fd = lock_folder(tmp_path / "ck", create=True)
    try:
        msg = _refused(lambda: lock_folder(tmp_path / "ck", create=True),
                       f"--checkpoint-dir {tmp_path / 'ck'}: in use by another job "
                       f"(pid {os.getpid()} on {socket.gethostname()}")
        assert msg.endswith("): wait for it to end or stop it, or give another folder")
    finally:
        release(fd)
    release(lock_folder(tmp_path / "ck", create=True))  # free again once released


def test_an_uncalibrated_cpu_cluster_is_named_and_a_gpu_preset_is_not():
    from amsp_planner.runtime.train import uncalibrated
    from amsp_planner.specs.loader import load_cluster

    cpu = load_cluster("cpu-local")
    assert uncalibrated(cpu).startswith("not calibrated for cpu-local")
    assert uncalibrated(load_cluster("dgx-a100-hdr")) is None


def test_the_checkpoint_error_lines_reach_the_cli_as_exit_2(ckpt, tmp_path):
    """End to end: checksums.json naming /dev/zero (it used to hang) is refused before
    launch, naming the file."""
    ck = tmp_path / "ck"
    shutil.copytree(ckpt["ck"], ck)
    (ck / "step_2" / SUMS).write_text(json.dumps({"/dev/zero": [0, "0" * 64]}))
    r = amsp("train", ckpt["plan"], "--steps", 4, "--checkpoint-dir", ck, "--resume",
             cwd=tmp_path, timeout=60)
    one_error_line(r, f"--resume: checkpoint step_2: {SUMS} is not a checksum table")
    assert isinstance(r, subprocess.CompletedProcess)


def test_report_and_checkpoint_dir_on_one_path_are_refused(tmp_path):
    import sys

    plan = Path(__file__).resolve().parents[1] / "golden" / "tiny_cpu-local_8.json"
    same = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "amsp_planner.cli.main", "train", str(plan),
                        "--steps", "1", "--checkpoint-dir", str(same), "--report", str(same)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().count("\n") == 0 and "--report and --checkpoint-dir" in p.stderr
    assert not same.exists()  # refused before anything was made
