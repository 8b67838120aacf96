"""Every JSON and YAML input (plans, specs, HF configs, ds_configs, calibrated specs) with a
poison value put anywhere in it: NaN, Infinity, a 5,000-deep nesting, a list or an object where
a scalar belongs. Each run ends in exit 0 (the value was in a field amsp ignores) or one line,
exit 2, never a traceback; non-finite numbers and deep nesting are always refused."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import yaml
from amsp_testlib import assert_user_error, doc_paths, put, run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from amsp_planner.specs.loader import PRESETS

DATA = Path(__file__).parent / "data"
GOLDEN = Path(__file__).parent / "golden"
DEEP = "[" * 5000 + "]" * 5000
# poison -> (JSON text, YAML text, always refused)
POISONS = {
    "nan": ("NaN", ".nan", True),
    "inf": ("Infinity", ".inf", True),
    "-inf": ("-Infinity", "-.inf", True),
    "deep": (DEEP, DEEP, True),
    "list": ('["llama", 1]', '["llama", 1]', False),
    "object": ('{"a": {"b": 1}}', '{"a": {"b": 1}}', False),
}
HF = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24, "vocab_size": 512,
      "hidden_act": "silu", "tie_word_embeddings": True, "max_position_embeddings": 256,
      "torch_dtype": "bfloat16"}
DS = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 1,
      "zero_optimization": {"stage": 3, "overlap_comm": True}, "bf16": {"enabled": True}}
PLAN = json.loads((GOLDEN / "tiny_cpu-local_8.json").read_text())
MODEL = yaml.safe_load((PRESETS / "model_specs" / "tiny.yaml").read_text())
CALIBRATED = yaml.safe_load((DATA / "emulated-2x4-calibrated.yaml").read_text())

# input kind -> (document, file suffix, argv with {} for the file)
JOB = ["--gpus", "8", "--global-batch-seqs", "64"]
INPUTS = {
    "plan (validate)": (PLAN, ".json", ["validate", "{}"]),
    "plan (explain)": (PLAN, ".json", ["explain", "{}"]),
    "model spec YAML": (MODEL, ".yaml", ["compare", "--model", "{}", "--cluster", "cpu-local",
                                         *JOB]),
    "model spec JSON": (MODEL, ".json", ["compare", "--model", "{}", "--cluster", "cpu-local",
                                         *JOB]),
    "HF config.json": (HF, ".json", ["compare", "--model", "{}", "--cluster", "cpu-local",
                                     *JOB]),
    "ds_config": (DS, ".json", ["compare", "--model", "tiny", "--cluster", "cpu-local", *JOB,
                                "--strategy-from", "{}"]),
    "calibrated spec": (CALIBRATED, ".yaml", ["compare", "--model", "tiny", "--cluster", "{}",
                                              *JOB]),
}


_n = itertools.count()


@st.composite
def poisoned(draw):
    kind = draw(st.sampled_from(sorted(INPUTS)))
    doc, suffix, argv = INPUTS[kind]
    path = draw(st.sampled_from(doc_paths(doc)))
    poison = draw(st.sampled_from(sorted(POISONS)))
    return kind, path, poison


@settings(max_examples=120, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(poisoned())
def test_poison_anywhere_in_any_input_is_one_line(tmp_path, case):
    kind, path, poison = case
    doc, suffix, argv = INPUTS[kind]
    as_json, as_yaml, refused = POISONS[poison]
    # JSON is YAML: write the document as JSON text and splice the poison in as text
    text = json.dumps(put(doc, path, "__POISON__"), indent=1)
    text = text.replace('"__POISON__"', as_json if suffix == ".json" else as_yaml)
    f = tmp_path / f"input{next(_n)}{suffix}"
    f.write_text(text)
    code, out, err = run_cli([a.replace("{}", str(f)) for a in argv])
    if code == 0 and not refused:
        return
    assert_user_error(code, out, err)


@pytest.mark.parametrize("kind", sorted(INPUTS))
@pytest.mark.parametrize("poison", ["nan", "deep"])
def test_poison_at_the_first_field_is_refused(tmp_path, kind, poison):
    doc, suffix, argv = INPUTS[kind]
    text = json.dumps(put(doc, doc_paths(doc)[0], "__POISON__"))
    f = tmp_path / f"first{suffix}"
    f.write_text(text.replace('"__POISON__"', POISONS[poison][0 if suffix == ".json" else 1]))
    line = assert_user_error(*run_cli([a.replace("{}", str(f)) for a in argv]))
    assert str(f) in line


def test_whole_file_nested_5000_deep_is_one_line(tmp_path):
    for suffix in (".json", ".yaml"):
        f = tmp_path / f"deep{suffix}"
        f.write_text(DEEP)
        assert_user_error(*run_cli(["specs", "show", str(f)]), "nested")
        assert_user_error(*run_cli(["validate", str(f)]), "nested")
