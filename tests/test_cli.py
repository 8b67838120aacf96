"""The `amsp` CLI: compare and specs output, one-line user errors (exit 2), no torch import."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import textwrap

import pytest
import yaml
from amsp_testlib import NO_TORCH, assert_user_error, run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from amsp_planner.specs import load_model
from amsp_planner.specs.loader import PRESETS
from amsp_planner.strategy import Strategy

SMALL = ["--model", "tiny", "--gpus", "16", "--cluster", "cpu-local", "--global-batch-seqs", "64"]


# ----- compare ----------------------------------------------------------------------------------
def test_compare_table_lists_the_baselines():
    code, out, err = run_cli(["compare", "--model", "llama-7b", "--gpus", "1024"])
    assert code == 0 and err == ""
    title = out.splitlines()[0]
    assert "llama-7b (6.74B) on 1024 GPUs of dgx-a100-hdr" in title
    assert "4,194,304 tokens/step" in title
    names = [line.split("│")[1].strip() for line in out.splitlines() if line.startswith("│")]
    assert names == ["ddp", "zero1", "zero2", "zero3", "hsdp", "mics", "zeropp"]


def test_compare_json_rows_and_given_strategies():
    code, out, _ = run_cli(["compare", *SMALL, "--json", "-s", "p=2,g=4,os=16,mb=2",
                            "-s", "zero3,mb=2,ckpt"])
    assert code == 0
    doc = json.loads(out)
    assert (doc["model"], doc["gpus"], doc["params"]) == ("tiny", 16, load_model("tiny").num_params)
    assert doc["padded_params"] >= doc["params"]
    rows = {r["name"]: r for r in doc["rows"] if not r["name"].startswith("given")}
    given_rows = [r for r in doc["rows"] if r["name"].startswith("given")]
    assert [r["name"] for r in given_rows] == ["given 1", "given 2"]
    assert set(rows) == {"ddp", "zero1", "zero2", "zero3", "hsdp", "mics", "zeropp"}
    assert [r["strategy"] for r in given_rows] == ["p=2,g=4,os=16,mb=2",
                                                   "p=16,g=16,os=16,mb=2,ckpt"]
    for r in doc["rows"]:  # every strategy string printed parses back
        Strategy.parse(r["strategy"])
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1
    # ZeRO-3 holds 16 B per padded parameter over 16 GPUs in model states.
    assert rows["zero3"]["memory"]["model_states"] == 16 * doc["padded_params"] / 16
    assert rows["ddp"]["memory"]["model_states"] == 16 * doc["padded_params"]


def test_compare_set_changes_the_cluster():
    _, base, _ = run_cli(["compare", *SMALL, "--json"])
    _, small_mem, _ = run_cli(["compare", *SMALL, "--json", "--set", "gpu.memory_gib=0.01"])
    assert all(r["fits"] for r in json.loads(base)["rows"])
    assert not any(r["fits"] for r in json.loads(small_mem)["rows"])


def test_compare_accepts_a_hf_config(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 176,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
           "vocab_size": 256, "tie_word_embeddings": True, "max_position_embeddings": 256}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    code, out, _ = run_cli(["compare", *SMALL[2:], "--model", str(p), "--json"])
    assert code == 0
    assert json.loads(out)["params"] == load_model("tiny").num_params


# ----- specs ------------------------------------------------------------------------------------
def test_specs_list_and_show():
    code, out, _ = run_cli(["specs", "list", "--json"])
    assert code == 0
    data = json.loads(out)
    assert "llama-7b" in data["models"] and "dgx-h100-ndr" in data["clusters"]
    code, out, _ = run_cli(["specs", "show", "llama2-70b", "--json"])
    d = json.loads(out)
    assert d["kind"] == "model"
    assert d["derived"]["params"] == pytest.approx(68.98e9, rel=0.005)
    code, out, _ = run_cli(["specs", "show", "dgx-h100-ndr", "--json"])
    d = json.loads(out)
    # 8 x NDR 400 Gb/s = 400 GB/s per node, at InfiniBand's 90 % of line rate: 360 GB/s.
    assert d["derived"]["node_nic_gbyte_per_s"] == pytest.approx(360)
    assert d["derived"]["intra_bus_gbyte_per_s_per_gpu"] == pytest.approx(450 * 0.8)


def test_help_and_version_exit_zero():
    for argv in (["--help"], ["compare", "--help"], ["--version"]):
        code, out, _ = run_cli(argv)
        assert code == 0 and out


# ----- user errors: one line, exit 2 --------------------------------------------------------------
@pytest.fixture
def spec_files(tmp_path):
    files = {
        "heads.yaml": "num_layers: 2\nhidden_size: 64\nnum_heads: 5\nffn_hidden_size: 176\n"
                      "vocab_size: 256\n",
        "negative.yaml": "num_layers: -2\nhidden_size: 64\nnum_heads: 4\nffn_hidden_size: 176\n"
                         "vocab_size: 256\n",
        "missing.yaml": "num_layers: 2\nhidden_size: 64\nnum_heads: 4\nvocab_size: 256\n",
        "syntax.yaml": "num_layers: [2\nhidden_size: 64\n",
        "list.yaml": "- 1\n- 2\n",
        "tag.yaml": "num_layers: !!int two\n",
        "moe.json": json.dumps({"model_type": "llama", "num_local_experts": 8}),
        "nokeys.json": json.dumps({"model_type": "llama", "hidden_size": 4096}),
        "badjson.json": "{\"model_type\": \"llama\",",
        "cluster.yaml": "gpu: {name: x, memory_gib: 80, peak_bf16_tflop_per_s: 300}\n"
                        "gpus_per_node: 8\nintra_gbyte_per_s: 300\nnics_per_node: 8\n"
                        "nic_gbit_per_s: 0\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return tmp_path


BAD_INPUTS = [
    # (argv after 'compare', text the one line must contain)
    (["--model", "llama-8b", "--gpus", "8"], "unknown model 'llama-8b'"),
    (["--model", "nope.yaml", "--gpus", "8"], "does not exist"),
    (["--model", "{d}/heads.yaml", "--gpus", "8"], "num_heads"),
    (["--model", "{d}/negative.yaml", "--gpus", "8"], "field 'num_layers'"),
    (["--model", "{d}/missing.yaml", "--gpus", "8"], "field 'ffn_hidden_size'"),
    (["--model", "{d}/syntax.yaml", "--gpus", "8"], "malformed YAML"),
    (["--model", "{d}/list.yaml", "--gpus", "8"], "expected a mapping"),
    (["--model", "{d}/tag.yaml", "--gpus", "8"], "malformed YAML"),
    (["--model", "{d}", "--gpus", "8"], "is a folder without a config.json"),
    (["--model", "{d}/moe.json", "--gpus", "8"], "'llama' with experts is not supported"),
    (["--model", "{d}/nokeys.json", "--gpus", "8"], "'num_hidden_layers' is missing"),
    (["--model", "{d}/badjson.json", "--gpus", "8"], "malformed JSON"),
    (["--model", "tiny", "--gpus", "8", "--cluster", "{d}/cluster.yaml"], "nic_gbit_per_s"),
    (["--model", "tiny", "--gpus", "8", "--cluster", "dgx-z100"], "unknown cluster"),
    (["--model", "tiny", "--gpus", "13"], "multiple of 8"),
    (["--model", "tiny", "--gpus", "3"], "divisor of 8"),
    (["--model", "tiny", "--gpus", "0"], "--gpus"),
    (["--model", "tiny", "--gpus", "eight"], "--gpus"),
    (["--model", "tiny"], "--gpus"),
    (["--model", "tiny", "--gpus", "2048"], "multiple of 2048"),  # 4M tokens = 1024 sequences
    (["--model", "tiny", "--gpus", "8", "--seq-len", "3000"], "--seq-len 3000"),
    (["--model", "tiny", "--gpus", "8", "--global-batch", "4Q"], "--global-batch"),
    (["--model", "tiny", "--gpus", "8", "--global-batch", "4M", "--global-batch-seqs", "8"],
     "not both"),
    (["--model", "gpt3-175b", "--gpus", "8", "--seq-len", "4096"], "max_seq_len 2048"),
    (["--model", "tiny", "--gpus", "8", "--set", "nic_gbps=400"], "no such cluster field"),
    (["--model", "tiny", "--gpus", "8", "--set", "gpu.memory_gib=-1"], "gpu.memory_gib"),
    (["--model", "tiny", "--gpus", "8", "--set", "oops"], "KEY=VALUE"),
    (["--model", "tiny", "--gpus", "8", "-s", "p=3"], "p=3"),
    (["--model", "tiny", "--gpus", "8", "-s", "p=x"], "'p=x' is not an integer"),
    (["--model", "tiny", "--gpus", "8", "-s", "zero4"], "unknown token 'zero4'"),
    (["--model", "tiny", "--gpus", "8", "-s", "zero1,os=8"], "after a baseline name"),
    (["--model", "tiny", "--gpus", "8", "-s", "mics-0"], "mics-P"),
    (["--model", "tiny", "--gpus", "8", "-s", "p=4,g=2,os=8"], "must nest"),
    (["--model", "tiny", "--gpus", "8", "-s", "p=8,g=8,os=8,hpz=8"], "hpz"),
    (["--model", "tiny", "--gpus", "8", "-s", "p=1,mb=3"], "mb=3"),
    (["--model", "tiny", "--gpus", "8", "--micro-batch", "3"], "--micro-batch 3"),
    (["--model", "tiny", "--gpus", "8", "--engine", "deepspeed", "--precision", "fp8"],
     "--precision"),
    (["--model", "tiny", "--gpus", "8", "--bogus"], "--bogus"),
]


@pytest.mark.parametrize("argv, needle", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2(spec_files, argv, needle):
    argv = [a.replace("{d}", str(spec_files)) for a in argv]
    assert_user_error(*run_cli(["compare", *argv]), needle)


def test_unknown_command_and_preset_are_one_line():
    assert_user_error(*run_cli(["comprae"]), "comprae")
    assert_user_error(*run_cli(["specs", "show", "llama-8b"]), "unknown preset 'llama-8b'")


def test_errors_through_the_installed_entry_point(spec_files):
    for argv, needle in ((["compare", "--model", "llama-8b", "--gpus", "8"], "llama-8b"),
                         (["compare", "--model", f"{spec_files}/heads.yaml", "--gpus", "8"],
                          "num_heads")):
        p = subprocess.run(["amsp", *argv], capture_output=True, text=True, timeout=60)
        assert_user_error(p.returncode, p.stdout, p.stderr, needle)


# ----- hypothesis: malformed spec files and strategy strings --------------------------------------
MODEL = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2,
         "ffn_hidden_size": 176, "vocab_size": 256, "tied_embeddings": True, "max_seq_len": 256}
MODEL_INT = ["num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size",
             "vocab_size", "max_seq_len"]
MODEL_REQUIRED = ["num_layers", "hidden_size", "num_heads", "ffn_hidden_size", "vocab_size"]
MODEL_OTHER = {"tied_embeddings": "bool", "ffn_type": "enum", "norm_type": "enum",
               "position_embedding": "enum", "attention_bias": "enum", "mlp_bias": "bool",
               "rope_theta": "float"}

CLUSTER = yaml.safe_load((PRESETS / "cluster_specs" / "cpu-local.yaml").read_text())
CLUSTER_NUM = ["gpus_per_node", "intra_gbyte_per_s", "intra_latency_us", "nics_per_node",
               "nic_gbit_per_s", "inter_latency_us", "nodes_per_leaf", "oversubscription",
               "bus_efficiency", "gpu.memory_gib", "gpu.peak_bf16_tflop_per_s",
               "gpu.achievable_fraction", "gpu.context_reserve_gib"]
CLUSTER_REQUIRED = ["gpu", "gpus_per_node", "intra_gbyte_per_s", "nics_per_node",
                    "nic_gbit_per_s", "gpu.name", "gpu.memory_gib", "gpu.peak_bf16_tflop_per_s"]
WRONG_TYPES = st.sampled_from(["abc", "", [1, 2], {"a": 1}, "8 GiB"])
NEGATIVE = st.integers(-10**9, -1) | st.floats(-1e9, -1e-3)
IDENT = st.from_regex(r"[a-z][a-z_]{1,12}", fullmatch=True)


def _set(doc, path, value):
    *parents, leaf = path.split(".")
    for p in parents:
        doc = doc[p]
    doc[leaf] = value


def _delete(doc, path):
    *parents, leaf = path.split(".")
    for p in parents:
        doc = doc[p]
    del doc[leaf]


@st.composite
def bad_model(draw):
    """(a model spec dict with exactly one problem, the field the error must name)."""
    doc = dict(MODEL)
    kind = draw(st.sampled_from(["missing", "type", "negative", "fraction", "unknown", "heads",
                                 "kv_heads", "enum"]))
    if kind == "missing":
        f = draw(st.sampled_from(MODEL_REQUIRED))
        del doc[f]
    elif kind == "type":
        f = draw(st.sampled_from(MODEL_INT + sorted(MODEL_OTHER)))
        doc[f] = draw(WRONG_TYPES)
    elif kind == "negative":
        f = draw(st.sampled_from(MODEL_INT + ["rope_theta"]))
        doc[f] = draw(NEGATIVE)
    elif kind == "fraction":
        f = draw(st.sampled_from(MODEL_INT))
        doc[f] = draw(st.integers(1, 100)) + 0.5
    elif kind == "unknown":
        f = draw(IDENT.filter(lambda k: k not in MODEL and k not in MODEL_OTHER and k != "name"))
        doc[f] = draw(st.integers() | st.text(max_size=5))
    elif kind == "heads":  # 64 is not a multiple of these
        f = "num_heads"
        doc[f] = draw(st.sampled_from([3, 5, 6, 7, 9, 10, 12, 48]))
        doc.pop("num_kv_heads")
    elif kind == "kv_heads":  # GQA groups: must divide num_heads = 4
        f = "num_kv_heads"
        doc[f] = draw(st.sampled_from([3, 5, 6, 8, 16]))
    else:
        f = draw(st.sampled_from(["ffn_type", "norm_type", "position_embedding",
                                  "attention_bias"]))
        doc[f] = draw(st.sampled_from(["relu", "none2", "RoPE", "bias", "1"]))
    return doc, f


@st.composite
def bad_cluster(draw):
    doc = json.loads(json.dumps(CLUSTER))
    kind = draw(st.sampled_from(["missing", "type", "negative", "unknown", "range"]))
    if kind == "missing":
        f = draw(st.sampled_from(CLUSTER_REQUIRED))
        _delete(doc, f)
    elif kind == "type":
        f = draw(st.sampled_from(CLUSTER_NUM + ["intra_fabric", "gpu"]))
        _set(doc, f, draw(WRONG_TYPES))
    elif kind == "negative":
        f = draw(st.sampled_from(CLUSTER_NUM))
        _set(doc, f, draw(NEGATIVE))
    elif kind == "unknown":
        where = draw(st.sampled_from(["", "gpu."]))
        f = where + draw(IDENT.filter(lambda k: k not in CLUSTER and k not in CLUSTER["gpu"]
                                      and k not in ("name", "measured", "fragmentation_fraction",
                                                    "quant_gbyte_per_s")))
        _set(doc, f, 1)
    else:
        f, v = draw(st.sampled_from([("oversubscription", 0.5), ("bus_efficiency", 1.5),
                                     ("gpu.achievable_fraction", 2.0), ("gpus_per_node", 0),
                                     ("gpu.fragmentation_fraction", 0.9)]))
        _set(doc, f, v)
    return doc, f


_counter = itertools.count()


def _write_yaml(folder, doc) -> str:
    p = folder / f"spec{next(_counter)}.yaml"  # a fresh name: loaders may cache by path
    p.write_text(yaml.safe_dump(doc))
    return str(p)


NO_FIXTURE_CHECK = settings(max_examples=60, deadline=None,
                            suppress_health_check=[HealthCheck.function_scoped_fixture])


@NO_FIXTURE_CHECK
@given(bad_model())
def test_malformed_model_specs_give_one_line(tmp_path, case):
    doc, field = case
    path = _write_yaml(tmp_path, doc)
    line = assert_user_error(*run_cli(["compare", "--model", path, "--gpus", "4",
                                       "--cluster", "cpu-local", "--global-batch-seqs", "8"]))
    assert path in line
    assert field.split(".")[-1] in line, (doc, line)


@NO_FIXTURE_CHECK
@given(bad_cluster())
def test_malformed_cluster_specs_give_one_line(tmp_path, case):
    doc, field = case
    path = _write_yaml(tmp_path, doc)
    line = assert_user_error(*run_cli(["compare", "--model", "tiny", "--gpus", "4",
                                       "--cluster", path, "--global-batch-seqs", "8"]))
    assert field.split(".")[-1] in line, (doc, line)


YAML_BREAKERS = ["[", "{", "]", "\t", ": :", "'", '"', "&", "*x", "? ", "- a\nb: c", "!!int x"]


@NO_FIXTURE_CHECK
@given(st.sampled_from(YAML_BREAKERS), st.integers(0, 60), st.sampled_from(["model", "cluster"]))
def test_broken_yaml_is_one_line(tmp_path, breaker, at, kind):
    text = yaml.safe_dump(MODEL if kind == "model" else CLUSTER)
    p = tmp_path / f"broken{next(_counter)}.yaml"
    p.write_text(text[:at] + breaker + text[at:])
    argv = ["compare", "--gpus", "4", "--global-batch-seqs", "8"]
    argv += ["--model", str(p), "--cluster", "cpu-local"] if kind == "model" else \
        ["--model", "tiny", "--cluster", str(p)]
    code, out, err = run_cli(argv)
    if code == 0:  # some insertions leave valid YAML and a valid spec (e.g. a quoted value)
        return
    assert_user_error(code, out, err, str(p))


BAD_TOKENS = ["p=0", "p=-2", "p=x", "g=", "os=2.5", "foo", "qgz=1", "ckpt=on", "qwz=3", "os=7",
              "p=3", "hpz=16", "mb=0", "ga=x", "=", "zero4", "mics-x"]
GOOD_TOKENS = ["p=1", "g=2", "os=4", "mb=1", "ckpt", "nockpt"]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.sampled_from(GOOD_TOKENS), max_size=3), st.sampled_from(BAD_TOKENS),
       st.integers(0, 3))
def test_malformed_strategy_strings_give_one_line(good, bad, at):
    tokens = list(good)
    tokens.insert(min(at, len(tokens)), bad)
    assert_user_error(*run_cli(["compare", *SMALL, "-s", ",".join(tokens)]), "--strategy")


@settings(max_examples=80, deadline=None)
@given(st.text(alphabet="pgoswzhqckmbaixr=,-0123456789 ", max_size=24))
def test_any_strategy_text_is_accepted_or_refused_in_one_line(text):
    code, out, err = run_cli(["compare", *SMALL, "--json", "-s", text])
    if code == 0:
        assert json.loads(out)["rows"][-1]["name"] == "given"
    else:
        assert_user_error(code, out, err)


# ----- no torch on the compare path --------------------------------------------------------------
def test_compare_does_not_import_torch():
    # A finder that refuses torch: if compare tried to import it, it would fail loudly.
    script = NO_TORCH + textwrap.dedent("""
        import sys
        from amsp_planner.cli.main import main
        try:
            main(["compare", "--model", "llama-7b", "--gpus", "1024", "--json"])
        except SystemExit as e:
            assert not e.code, e.code
        heavy = sorted(m for m in ("torch", "matplotlib", "pulp", "highspy") if m in sys.modules)
        print("HEAVY", heavy, file=sys.stderr)
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["gpus"] == 1024
    assert "HEAVY []" in p.stderr


# ----- outputs never replace what they did not write --------------------------------------------
@pytest.fixture
def a_plan(tmp_path):
    path = tmp_path / "plan.json"
    code, _, err = run_cli(["plan", "--model", "tiny", "--gpus", "8", "--cluster", "cpu-local",
                            "--seq-len", "64", "--global-batch-seqs", "16", "-o", str(path)])
    assert code == 0, err
    return path


@pytest.mark.parametrize("argv, needle", [
    (["export", "{plan}", "--to", "deepspeed", "-o", "{plan}"], "-o {plan}: exists and is not"),
    (["export", "{plan}", "--to", "fsdp2", "-o", "{plan}"], "-o {plan}: exists and is not"),
    (["whatif", "--model", "tiny", "--gpus", "8", "--csv", "{plan}"], "--csv {plan}: exists"),
    (["whatif", "--model", "tiny", "--gpus", "8", "--json", "{plan}"], "--json {plan}: exists"),
    (["whatif", "--model", "tiny", "--gpus", "8", "--plot", "{plan}"], "--plot {plan}: exists"),
    (["calibrate", "--nproc", "2", "--out", "{plan}"], "--out {plan}: exists and is not"),
    (["whatif", "--model", "tiny", "--gpus", "8", "--plot", "{dir}/sweep.xyz"],
     "--plot {dir}/sweep.xyz: matplotlib cannot write '.xyz' images"),
    (["plan", "--model", "tiny", "--gpus", "8", "-o", "{dir}"], "-o {dir}: is a folder"),
])
def test_outputs_refuse_to_replace_other_files(a_plan, argv, needle):
    before = a_plan.read_bytes()
    fill = {"plan": str(a_plan), "dir": str(a_plan.parent)}
    code, out, err = run_cli([a.format(**fill) for a in argv])
    assert_user_error(code, out, err, needle.format(**fill))
    assert a_plan.read_bytes() == before
    assert sorted(p.name for p in a_plan.parent.iterdir()) == ["plan.json"]


def test_outputs_replace_their_own_earlier_files(a_plan, tmp_path):
    for argv in (["export", str(a_plan), "--to", "deepspeed", "-o", str(tmp_path / "ds.json")],
                 ["whatif", "--model", "tiny", "--gpus", "8", "--csv", str(tmp_path / "w.csv"),
                  "--plot", str(tmp_path / "w.svg")]):
        for _ in range(2):  # the second run replaces the first one's files
            code, _, err = run_cli(argv)
            assert code == 0, err
    assert json.loads((tmp_path / "ds.json").read_text())["zero_optimization"]
    assert (tmp_path / "w.svg").read_bytes().startswith(b"<?xml")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporaries


@pytest.mark.parametrize("argv", [
    ["compare", "--model", "tiny", "--gpus", "8", "--strategy-from", "{bad}"],
    ["export", "{bad}", "--to", "deepspeed"],
    ["explain", "{bad}"],
    ["validate", "{bad}"],
])
def test_files_that_are_not_text_give_one_line(tmp_path, argv):
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"\xff\xfe\x00binary")
    code, out, err = run_cli([a.format(bad=bad) for a in argv])
    assert_user_error(code, out, err, "not UTF-8")


# ----- plan: the cyclic garbage collector ---------------------------------------------------------
@pytest.mark.parametrize("fails", [False, True])
def test_plan_runs_without_the_cyclic_collector_and_turns_it_back_on(fails, tmp_path,
                                                                     monkeypatch):
    import gc

    import amsp_planner.solver as solver_pkg

    seen = []
    real = solver_pkg.solve

    def spy(*a, **k):
        seen.append(gc.isenabled())
        if fails:
            from amsp_planner.errors import AmspUserError

            raise AmspUserError("--model: a failure inside the command")
        return real(*a, **k)

    monkeypatch.setattr(solver_pkg, "solve", spy)
    assert gc.isenabled()
    code, _, err = run_cli(["plan", *SMALL, "-o", str(tmp_path / "p.json")])
    assert seen == [False]  # off while it planned
    assert gc.isenabled()  # on again, also after a one-line error
    assert code == (2 if fails else 0), err


def test_compare_names_the_tp_under_which_the_baselines_divide_the_batch():
    # 4M tokens = 1,024 sequences of 4096 cannot spread over 4,096 data-parallel ranks at tp=1:
    # one line naming the fix (amsp plan finds tp=4 by itself), not a baseline's --strategy
    argv = ["compare", "--model", "llama3-8b", "--gpus", "4096", "--cluster", "dgx-h100-ndr"]
    code, out, err = run_cli(argv)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "global batch of 1,024 sequences" in err and "give --tp 4 (1024 ranks)" in err
    assert "--strategy" not in err
    code, out, err = run_cli(argv + ["--tp", "4", "--json"])
    assert code == 0 and all(r["strategy"].startswith("tp=4,") for r in json.loads(out)["rows"])
