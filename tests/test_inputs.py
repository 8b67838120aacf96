"""Every path amsp reads or writes, every number and type it reads, and the names a new user
writes: each bad kind ends in exit 2 and one line on stderr naming the path, field or option,
no traceback, nothing already written lost, nothing left behind. A FIFO or a device is never
opened for reading, so no test here can hang (each is bounded by ``deadline`` anyway)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import tempfile
from pathlib import Path

import pytest
import yaml
from amsp_testlib import assert_user_error, doc_paths, get, put, run_cli, tmpfs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from amsp_planner.specs import load_cluster
from amsp_planner.specs.loader import PRESETS

GOLDEN = Path(__file__).parent / "golden"
DATA = Path(__file__).parent / "data"
PLAN_TEXT = (GOLDEN / "tiny_cpu-local_8.json").read_text()
TINY = ["--model", "tiny", "--gpus", "8", "--cluster", "cpu-local", "--global-batch-seqs", "64"]
JOB = ["--gpus", "8", "--global-batch-seqs", "64"]
def SETTINGS(n: int):  # noqa: N802
    return settings(max_examples=n, deadline=None, derandomize=True, suppress_health_check=[
        HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


class Hang(Exception):
    pass


@contextlib.contextmanager
def deadline(seconds: float = 10.0):
    """Fail (not hang) when the body takes longer than `seconds`: a read of a FIFO waits for a
    writer forever."""
    def alarm(signum, frame):
        raise Hang(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def cli(argv, seconds: float = 20.0):
    with deadline(seconds):
        return run_cli([str(a) for a in argv])


# ----- reading: only regular files of bounded size ---------------------------------------------
# reader -> argv with {} for the path
READERS = {
    "model spec": ["compare", "--model", "{}", "--cluster", "cpu-local", *JOB],
    "cluster spec": ["compare", "--model", "tiny", "--cluster", "{}", *JOB],
    "ds_config": ["compare", *TINY, "--strategy-from", "{}"],
    "plan (validate)": ["validate", "{}"],
    "plan (explain)": ["explain", "{}"],
    "plan (export)": ["export", "{}", "--to", "deepspeed"],
    "spec (specs show)": ["specs", "show", "{}"],
}


def _bad_input(kind: str, tmp: Path) -> tuple[str, str]:
    """(path, a word the refusal must hold) of one kind of bad input path."""
    if kind == "fifo":
        p = tmp / "pipe.json"
        if not p.exists():
            os.mkfifo(p)
        return str(p), "FIFO"
    if kind in ("/dev/zero", "/dev/urandom"):
        return kind, "character device"
    if kind == "folder":
        (tmp / "dir.json").mkdir(exist_ok=True)
        return str(tmp / "dir.json"), "folder"
    if kind == "long path":
        return str(tmp / ("x" * 5000)) + ".json", "limit"
    if kind == "long name":
        return str(tmp / ("y" * 300)) + ".json", "limit"
    if kind == "oversized":
        p = tmp / "big.json"
        with open(p, "wb") as f:
            f.truncate(17 * 2**20)  # sparse: 17 MiB of zeros
        return str(p), "16,777,216 bytes"
    raise AssertionError(kind)


@SETTINGS(40)
@given(st.sampled_from(sorted(READERS)),
       st.sampled_from(["fifo", "/dev/zero", "/dev/urandom", "folder", "long path",
                        "long name", "oversized"]))
def test_an_input_that_is_not_a_bounded_regular_file_is_refused_before_reading(reader, kind):
    with tempfile.TemporaryDirectory() as tmp:
        path, word = _bad_input(kind, Path(tmp))
        code, out, err = cli([a.replace("{}", path) for a in READERS[reader]], seconds=10)
    line = assert_user_error(code, out, err)
    assert word in line or (kind == "folder" and "directory" in line), line
    assert path[:40] in line, line
    assert len(line) < 1000


def test_an_unreadable_input_names_the_path_and_the_cause(tmp_path, monkeypatch):
    spec = tmp_path / "secret.yaml"
    spec.write_text((PRESETS / "cluster_specs" / "cpu-local.yaml").read_text())
    if os.geteuid() == 0:  # root reads any file: refuse it the way the kernel would
        real = os.open

        def no_read(path, *a, **kw):
            if os.fspath(path) == str(spec):
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return real(path, *a, **kw)

        monkeypatch.setattr(os, "open", no_read)
    else:
        spec.chmod(0)
    line = assert_user_error(*cli(["compare", "--model", "tiny", "--cluster", spec, *JOB]))
    assert str(spec) in line and "permission denied" in line.lower()


# ----- writing: one line naming the path and the cause, nothing lost, nothing left -------------
def _fail_in(folder: Path, err: int):
    """A tempfile.mkstemp that fails with `err` in `folder` (a read-only file system, a folder
    without write permission: what root, which bypasses permissions, cannot make)."""
    real = tempfile.mkstemp

    def mkstemp(*a, dir=None, **kw):
        if dir is not None and Path(dir).resolve() == folder.resolve():
            raise OSError(err, os.strerror(err))
        return real(*a, dir=dir, **kw)

    return mkstemp


# writer -> (argv with {} for the output path, suffix, an earlier output of its kind or None)
WRITERS = {
    "plan -o": (["plan", *TINY, "-o", "{}"], ".json", PLAN_TEXT),
    "whatif --csv": (["whatif", *TINY, "--csv", "{}"], ".csv", None),
    "whatif --json": (["whatif", *TINY, "--json", "{}"], ".json", None),
    "whatif --plot": (["whatif", *TINY, "--plot", "{}"], ".png", None),
    "export -o": (["export", GOLDEN / "tiny_cpu-local_8.json", "--to", "fsdp2", "-o", "{}"],
                  ".py", None),
    "calibrate --out": (["calibrate", "--out", "{}"], ".yaml", None),
}


@SETTINGS(30)
@given(st.sampled_from(sorted(WRITERS)),
       st.sampled_from(["EROFS", "EACCES", "ENOSPC", "fifo", "/dev/full", "/dev/null",
                        "long name"]))
def test_an_output_that_cannot_be_written_is_one_line_and_leaves_nothing(writer, kind):
    argv, suffix, earlier = WRITERS[writer]
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        folder = Path(tmp)
        target = folder / f"out{suffix}"
        if kind in ("EROFS", "EACCES", "ENOSPC"):
            mp.setattr(tempfile, "mkstemp", _fail_in(folder, getattr(errno, kind)))
            cause = os.strerror(getattr(errno, kind)).lower()
            if earlier is not None:  # an earlier output of the kind may be replaced: keep it
                target.write_text(earlier)
        elif kind == "fifo":
            os.mkfifo(target)
            cause = "FIFO"
        elif kind == "long name":
            target = folder / ("z" * 300 + suffix)
            cause = "limit"
        else:
            target, cause = Path(kind), "character device"
        before = sorted(os.listdir(folder))
        kept = kind in ("EROFS", "EACCES", "ENOSPC") and earlier is not None
        mtime = target.stat().st_mtime_ns if kept else None
        code, out, err = cli([str(a).replace("{}", str(target)) for a in argv], seconds=30)
        line = assert_user_error(code, out, err, cause)
        assert str(target)[:40] in line
        assert sorted(os.listdir(folder)) == before  # no temporary file, nothing new
        if mtime is not None:
            assert target.stat().st_mtime_ns == mtime and target.read_text() == earlier


def test_a_write_that_fails_midway_keeps_the_earlier_file_and_leaves_no_temporary(
        tmp_path, monkeypatch):
    target = tmp_path / "plan.json"
    target.write_text(PLAN_TEXT)

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    line = assert_user_error(*cli(["plan", *TINY, "-o", target]), "no space left")
    assert str(target) in line
    assert target.read_text() == PLAN_TEXT
    assert os.listdir(tmp_path) == ["plan.json"]


def test_the_default_plan_json_in_a_read_only_folder_is_refused_before_the_search(
        tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "mkstemp", _fail_in(tmp_path, errno.EROFS))
    import amsp_planner.solver as solver

    def no_search(*a, **kw):
        raise AssertionError("searched before refusing the output")

    monkeypatch.setattr(solver, "solve", no_search)
    assert_user_error(*cli(["plan", *TINY]), "plan.json", "read-only file system")
    assert os.listdir(tmp_path) == []


def test_real_full_and_read_only_file_systems(tmp_path):
    """On a 64 kB tmpfs: a plan that does not fit is one line, the earlier plan kept and no
    temporary file left; on a read-only one, -o and --csv are refused before any work."""
    with tmpfs(tmp_path / "full", "64k") as mnt:
        target = mnt / "plan.json"
        target.write_text(PLAN_TEXT)
        filler = mnt / "filler"
        with open(filler, "wb") as f:  # leave less room than a plan takes
            with contextlib.suppress(OSError):
                f.write(b"\0" * 64 * 1024)
        line = assert_user_error(*cli(["plan", *TINY, "-o", target]), "no space left")
        assert str(target) in line
        assert target.read_text() == PLAN_TEXT
        assert sorted(os.listdir(mnt)) == ["filler", "plan.json"]
    with tmpfs(tmp_path / "ro", "64k", read_only=True) as mnt:
        for argv in (["plan", *TINY, "-o", mnt / "p.json"], ["whatif", *TINY, "--csv",
                                                            mnt / "w.csv"]):
            assert_user_error(*cli(argv), "read-only file system", str(mnt))


@pytest.mark.parametrize("outputs", [
    ("--csv", "x.out", "--json", "x.out"),
    ("--plot", "x.png", "--csv", "x.png"),
    ("--json", "x.json", "--plot", "./x.json"),
])
def test_two_outputs_of_one_command_on_one_path_are_refused_before_any_work(
        tmp_path, monkeypatch, outputs):
    monkeypatch.chdir(tmp_path)
    import amsp_planner.whatif as w

    monkeypatch.setattr(w, "run", lambda *a, **k: (_ for _ in ()).throw(AssertionError("ran")))
    line = assert_user_error(*cli(["whatif", *TINY, *outputs]), outputs[0], outputs[2])
    assert "same file" in line
    assert os.listdir(tmp_path) == []


# ----- numbers and types -------------------------------------------------------------------------
MODEL = yaml.safe_load((PRESETS / "model_specs" / "tiny.yaml").read_text())
CLUSTER = yaml.safe_load((PRESETS / "cluster_specs" / "cpu-local.yaml").read_text())
CALIBRATED = yaml.safe_load((DATA / "emulated-2x4-calibrated.yaml").read_text())
HF = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24, "vocab_size": 512,
      "hidden_act": "silu", "tie_word_embeddings": True, "max_position_embeddings": 256,
      "rope_theta": 10000.0}
# fields where 0 (and so a tiny positive number) is meaningful: latencies, overheads, fractions
# of something that may be absent
ZERO_OK = {"intra_latency_us", "inter_latency_us", "kernel_overhead_us", "comm_compute_slowdown",
           "context_reserve_gib", "fragmentation_fraction", "overlap_efficiency"}
# bad value -> (YAML/JSON text, --set text, refused also where 0 is meaningful)
BAD = {
    "nan": (".nan", "nan", True), "inf": (".inf", "inf", True), "huge": ("1.0e308", "1e308", True),
    "subnormal": ("1.0e-320", "1e-320", False), "true": ("true", "true", True),
    "yes": ("yes", "yes", True), "on": ("on", "on", True), "string": ('"8"', "eight", True),
    "negative": ("-4", "-4", True),
}
ZERO_SIZES = {"num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size",
              "vocab_size", "max_seq_len", "head_dim", "rope_theta", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "intermediate_size",
              "max_position_embeddings", "gpus_per_node", "nics_per_node", "nodes_per_leaf",
              "size_bytes"}


def _numeric_paths(doc):
    """Key paths of every number in a document (not booleans)."""
    return [p for p in doc_paths(doc) if isinstance(get(doc, p), int | float)
            and not isinstance(get(doc, p), bool)]


CLUSTER_FULL = json.loads(json.dumps(load_cluster("cpu-local").model_dump(mode="json")))
# spec -> (document, suffix, argv with {} for the file)
SPECS = {
    "model": (MODEL, ".yaml", ["compare", "--model", "{}", "--cluster", "cpu-local", *JOB]),
    "cluster": (CLUSTER_FULL, ".yaml", ["compare", "--model", "tiny", "--cluster", "{}", *JOB]),
    "calibrated": (CALIBRATED, ".yaml", ["compare", "--model", "tiny", "--cluster", "{}", *JOB]),
    "hf": (HF, ".json", ["compare", "--model", "{}", "--cluster", "cpu-local", *JOB]),
}


@st.composite
def bad_number(draw):
    spec = draw(st.sampled_from(sorted(SPECS)))
    path = draw(st.sampled_from(_numeric_paths(SPECS[spec][0])))
    names = {str(p) for p in path}
    choices = [b for b, (_, _, strict) in BAD.items() if strict or not names & ZERO_OK]
    if names & ZERO_SIZES:
        choices.append("zero")
    return spec, path, draw(st.sampled_from(choices))


@SETTINGS(80)
@given(bad_number())
def test_a_bad_number_in_any_spec_field_is_refused_naming_it(case):
    spec, path, bad = case
    doc, suffix, argv = SPECS[spec]
    text_value = "0" if bad == "zero" else BAD[bad][0]
    if suffix == ".json":
        text_value = {"yes": '"yes"', "on": '"on"', ".nan": "NaN", ".inf": "Infinity"}.get(
            text_value, text_value if bad not in ("nan", "inf") else
            {"nan": "NaN", "inf": "Infinity"}[bad])
    text = json.dumps(put(doc, path, "__BAD__"), indent=1).replace('"__BAD__"', text_value)
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / f"spec{suffix}"
        f.write_text(text)
        code, out, err = cli([a.replace("{}", str(f)) for a in argv])
    line = assert_user_error(code, out, err)
    field = str(path[-1]) if not isinstance(path[-1], int) else str(path[-2])
    assert field in line or (bad in ("nan", "inf") and str(f) in line), (path, bad, line)


def test_strict_types_take_every_spelling_of_a_number_and_no_other_type(tmp_path):
    from amsp_planner.specs import load_model

    f = tmp_path / "m.yaml"
    f.write_text(yaml.safe_dump({**MODEL, "rope_theta": "__X__"}).replace("__X__", "1e6"))
    assert load_model(str(f)).rope_theta == 1e6  # YAML 1.2's exponent float, an int for a float
    c = tmp_path / "c.yaml"
    c.write_text(yaml.safe_dump({**CLUSTER, "nic_gbit_per_s": 200}))
    assert load_cluster(str(c)).nic_gbit_per_s == 200.0
    for value in ("yes", "on", "true"):
        f.write_text(yaml.safe_dump({**MODEL, "num_layers": "__X__"}).replace("__X__", value))
        load_model.cache_clear()
        assert_user_error(*cli(["compare", "--model", f, "--cluster", "cpu-local", *JOB]),
                          "num_layers", "boolean")


SET_FIELDS = ["gpus_per_node", "intra_gbyte_per_s", "nics_per_node", "nic_gbit_per_s",
              "nodes_per_leaf", "oversubscription", "bus_efficiency", "intra_latency_us",
              "gpu.memory_gib", "gpu.peak_bf16_tflop_per_s", "gpu.hbm_gbyte_per_s",
              "gpu.achievable_fraction", "gpu.quant_gbyte_per_s", "gpu.optimizer_gbyte_per_s",
              "gpu.context_reserve_gib", "gpu.fragmentation_fraction"]


@SETTINGS(60)
@given(st.sampled_from(SET_FIELDS), st.sampled_from(sorted(BAD)))
def test_a_bad_set_value_is_refused_naming_the_option(field, bad):
    _, value, strict = BAD[bad]
    if not strict and field.split(".")[-1] in ZERO_OK:
        return  # a subnormal latency or reserve is a valid (negligible) one
    line = assert_user_error(*cli(["compare", *TINY, "--set", f"{field}={value}"]))
    assert f"--set {field}" in line, line


@pytest.mark.parametrize("key, value", [
    ("tie_word_embeddings", '"false"'), ("num_hidden_layers", "true"),
    ("num_key_value_heads", "0"), ("rope_theta", "0"), ("max_position_embeddings", "0"),
    ("attention_bias", '"no"'), ("hidden_size", "64.0"),
])
def test_a_hf_config_value_of_the_wrong_type_or_zero_is_refused_naming_its_key(
        tmp_path, key, value):
    f = tmp_path / "config.json"
    f.write_text(json.dumps({**HF, key: "__BAD__"}).replace('"__BAD__"', value))
    assert_user_error(*cli(["compare", "--model", f, "--cluster", "cpu-local", *JOB]), key)


@pytest.mark.parametrize("argv, option", [
    (["compare", *TINY, "--memory-limit", "nan"], "--memory-limit"),
    (["compare", *TINY, "--memory-limit", "inf"], "--memory-limit"),
    (["plan", *TINY, "-o", "-", "--memory-limit", "1e308"], "--memory-limit"),
    (["plan", *TINY, "-o", "-", "--time-limit", "nan"], "--time-limit"),
    (["whatif", *TINY, "--time-limit", "nan"], "--time-limit"),
    (["calibrate", "--seconds-per-point", "nan"], "--seconds-per-point"),
    (["calibrate", "--timeout", "inf"], "--timeout"),
    (["calibrate", "--passes", "100000"], "--passes"),
    (["calibrate", "--matmul-size", "10000000"], "--matmul-size"),
    (["whatif", "--model", "tiny", "--cluster", "cpu-local", "--gpus", "9" * 23], "--gpus"),
    (["whatif", "--model", "tiny", "--cluster", "cpu-local", "--gpus", "8", "--seq-len",
      "2000000"], "--seq-len"),
])
def test_a_non_finite_or_huge_option_is_refused_naming_it(argv, option):
    assert_user_error(*cli(argv), option)


@pytest.mark.parametrize("argv, needles", [
    (["plan", "--model", "tiny", "--gpus", "8", "--cluster", "", "-o", "-"],
     ("--cluster is empty",)),  # was the default cluster, silently
    (["plan", "--model", " ", "--gpus", "8", "-o", "-"], ("--model is empty",)),
    (["plan", *TINY, "-o", "no_such_folder/"], ("-o no_such_folder/", "ends with /")),
    (["plan", *TINY, "-o", ""], ("-o is empty",)),
])
def test_an_empty_name_or_a_folder_path_is_refused(argv, needles, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert_user_error(*cli(argv), *needles)
    assert not any(tmp_path.iterdir())  # -o no_such_folder/ wrote a file of that name


@pytest.mark.parametrize("field, value", [("num_gpus", "8"), ("num_gpus", 8.0),
                                          ("num_gpus", True), ("version", 5.0)])
def test_a_plan_number_of_another_type_is_refused(tmp_path, field, value):
    """JSON has one number type per kind: "8", 8.0 or true for a GPU count is an edited plan
    (true read as 1 GPU), refused naming the field, before its hashes are checked."""
    doc = json.loads(PLAN_TEXT)
    (doc["inputs"] if field == "num_gpus" else doc)[field] = value
    f = tmp_path / "p.json"
    f.write_text(json.dumps(doc))
    where = f"inputs.{field}" if field == "num_gpus" else field
    assert_user_error(*cli(["explain", f]), f"field '{where}'", "valid integer")


# ----- duplicate keys, alias bombs, long echoes ---------------------------------------------------
def _dump_twice(doc, path, value) -> str:
    """JSON text of `doc` in which the mapping at path[:-1] gives key path[-1] twice (first
    `value`, then the document's own)."""
    if not path:
        return json.dumps(doc)
    if isinstance(doc, dict):
        parts = []
        for k, v in doc.items():
            if k == path[0] and len(path) == 1:
                parts.append(f"{json.dumps(k)}: {json.dumps(value)}")
            sub = _dump_twice(v, path[1:], value) if k == path[0] else json.dumps(v)
            parts.append(f"{json.dumps(k)}: {sub}")
        return "{" + ", ".join(parts) + "}"
    return "[" + ", ".join(_dump_twice(v, path[1:], value) if i == path[0] else json.dumps(v)
                           for i, v in enumerate(doc)) + "]"


DS = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 1,
      "zero_optimization": {"stage": 3, "overlap_comm": True}, "bf16": {"enabled": True}}
DUP_INPUTS = {
    **{k: v for k, v in SPECS.items()},
    "ds_config": (DS, ".json", ["compare", *TINY, "--strategy-from", "{}"]),
    "plan": (json.loads(PLAN_TEXT), ".json", ["validate", "{}"]),
}


@st.composite
def duplicated(draw):
    kind = draw(st.sampled_from(sorted(DUP_INPUTS)))
    doc = DUP_INPUTS[kind][0]
    return kind, draw(st.sampled_from([p for p in doc_paths(doc) if isinstance(p[-1], str)]))


@SETTINGS(50)
@given(duplicated())
def test_a_key_given_twice_is_refused_naming_it(case):
    kind, path = case
    doc, suffix, argv = DUP_INPUTS[kind]
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp) / f"doc{suffix}"
        f.write_text(_dump_twice(doc, path, 7))
        line = assert_user_error(*cli([a.replace("{}", str(f)) for a in argv]), "twice")
    assert f"'{path[-1]}'" in line and str(f) in line


def test_a_yaml_alias_bomb_is_refused_fast(tmp_path):
    f = tmp_path / "bomb.yaml"
    f.write_text('a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n"
        for i in range(8)))
    for argv in (["compare", "--model", "tiny", "--cluster", f, *JOB], ["specs", "show", f]):
        assert_user_error(*cli(argv, seconds=5), str(f), "values")
    # aliases themselves are bounded, not refused: a merge key ('<<') that a key overrides is
    # neither a bomb nor a key given twice
    from amsp_planner.textfile import parse

    assert parse("b: &b {x: 1, y: 2}\nc: {<<: *b, x: 3}\n", "yaml") == {
        "b": {"x": 1, "y": 2}, "c": {"x": 3, "y": 2}}


@pytest.mark.parametrize("argv", [
    ["compare", *TINY, "--strategy", "p=8," * 25_000],
    ["compare", *TINY, "--set", "gpu=" + "H" * 100_000],
    ["compare", *TINY, "--set", "k" * 100_000 + "=1"],
    ["compare", *TINY, "--global-batch", "9" * 100_000 + "Q"],
])
def test_an_error_line_cuts_a_long_echoed_input_and_says_so(argv):
    line = assert_user_error(*cli(argv), "cut")
    assert len(line) < 1100


# ----- names a new user writes ---------------------------------------------------------------
def test_set_gpu_takes_the_gpu_name_cluster_files_use():
    c = load_cluster("dgx-a100-hdr", {"gpu": "H100-SXM5-80GB", "gpu.memory_gib": 40})
    assert (c.gpu.name, c.gpu.memory_gib, c.gpu.arch) == ("H100-SXM5-80GB", 40, "hopper")
    code, out, err = cli(["compare", *TINY, "--set", "gpu=H100-SXM5-80GB", "--json"])
    assert code == 0, err


@pytest.mark.parametrize("argv, meant", [
    (["--model", "tiny", "--cluster", "dgx-a100"], "dgx-a100-hdr"),
    (["--model", "llama-7B"], "llama-7b"),
    (["--model", "llama-70b"], "llama2-70b"),
    (["--model", "tiny", "--cluster", "dgx-a100-hdr", "--set", "gpu=h100-sxm5-80gb"],
     "H100-SXM5-80GB"),
    (["--model", "tiny", "--cluster", "dgx-a100-hdr", "--set", "nic_gbit_per_sec=400"],
     "nic_gbit_per_s"),
])
def test_a_near_miss_is_refused_with_what_was_meant(argv, meant):
    assert_user_error(*cli(["compare", "--gpus", "8", *argv]), f"did you mean {meant}?")


def test_a_partial_node_names_the_set_that_plans_it():
    line = assert_user_error(*cli(["compare", "--model", "llama-7b", "--gpus", "6"]),
                             "--set gpus_per_node=6")
    code, _, err = cli(["compare", "--model", "llama-7b", "--gpus", "6", "--set",
                        "gpus_per_node=6", "--global-batch-seqs", "60"])
    assert code == 0, (line, err)


def test_batch_errors_name_the_options_not_the_fields():
    line = assert_user_error(*cli(["compare", "--model", "llama-7b", "--gpus", "8",
                                   "--global-batch", "4000000"]), "--global-batch", "--seq-len")
    assert "global_batch_tokens" not in line and "seq_len" not in line


@pytest.mark.parametrize("text, needles", [
    ("num_layers: 2\nhiden_size: 64\nnum_heads: 4\nffn_hidden_size: 176\nvocab_size: 256\n",
     ("field 'hiden_size'", "did you mean 'hidden_size'?")),
    ("num_layers: 2\nhidden_size: 64\nnum_heads: 4\nffn_hidden_size: -1\nvocab_size: 256\n",
     ("field 'ffn_hidden_size'", "greater than or equal to 1, got -1")),
])
def test_a_spec_field_error_names_the_field_meant_or_the_value_given(tmp_path, text, needles):
    f = tmp_path / "m.yaml"
    f.write_text(text)
    assert_user_error(*cli(["compare", "--model", f, "--cluster", "cpu-local", *JOB]), *needles)


def test_an_unknown_nested_set_key_is_not_called_a_bad_value():
    assert_user_error(*cli(["compare", *TINY, "--set", "gpu.memry_gib=40"]),
                      "--set gpu.memry_gib=40: no such field: did you mean gpu.memory_gib?")


def test_a_huge_integer_or_a_python_tag_is_named_as_such(tmp_path):
    """Not 'malformed YAML': a JSON plan with an integer past Python's 4,300-digit limit, and a
    YAML spec with a !!python tag (never constructed), each get their own reason."""
    plan = tmp_path / "p.json"
    plan.write_text(PLAN_TEXT.replace('"version": ', '"version": 1' + "0" * 5000 + ', "x": ', 1))
    assert_user_error(*cli(["explain", plan]), "more than 4,300 digits")
    spec = tmp_path / "m.yaml"
    spec.write_text('num_layers: 2\nhidden_size: !!python/object/apply:os.getpid []\n')
    assert_user_error(*cli(["compare", "--model", spec, "--cluster", "cpu-local", *JOB]),
                      "unsupported YAML tag at line 2")


@pytest.mark.parametrize("option, path, needles", [
    ("--cluster", PRESETS / "model_specs" / "tiny.yaml", ("is a model spec", "as --model")),
    ("--model", PRESETS / "cluster_specs" / "cpu-local.yaml", ("is a cluster spec", "as --cluster")),
    ("--model", GOLDEN / "tiny_cpu-local_8.json", ("is a plan file, not a model spec",)),
])
def test_a_file_of_another_kind_is_named_as_such(option, path, needles):
    """One line saying what the file is (it was a run of every field found missing)."""
    argv = ["compare", "--model", "tiny", "--cluster", "cpu-local", *JOB]
    argv[argv.index(option) + 1] = path
    assert_user_error(*cli(argv), *needles)


def test_a_set_field_given_twice_is_refused():
    assert_user_error(*cli(["compare", *TINY, "--set", "gpu.memory_gib=40", "--set",
                            "gpu.memory_gib=80"]), "--set gpu.memory_gib: given twice")


def test_specs_show_names_its_argument_not_an_option():
    """`amsp specs show NAME` has no --model: its refusals name NAME alone."""
    line = assert_user_error(*cli(["specs", "show", GOLDEN / "tiny_cpu-local_8.json"]),
                             "is a plan file, not a model spec")
    assert "--model" not in line and "--cluster" not in line, line
