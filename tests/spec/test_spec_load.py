import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.errors import DsmtError, SpecError
from toolkit.spec import schema
from toolkit.spec.load import apply_overrides, load_spec
from spec_helpers import tiny_spec


def test_model_only_spec_is_complete(write_spec):
    spec = load_spec(write_spec({"model": {"builtin": "llama3-8b"}}))
    assert (spec.parallel.tp, spec.parallel.zero_stage, spec.cluster.nodes) == (1, 1, 1)
    assert spec.training.precision == "bf16" and spec.data.path is None


def test_torch_dtype_names_are_read_as_the_short_precision_names(write_spec):
    """`bfloat16` as HF configs write it (torch_dtype) is what a user types: the validated spec holds bf16."""
    path = write_spec(tiny_spec(training={"precision": "bfloat16"}, communication={"grad_accum_dtype": "float32"}))
    spec = load_spec(path)
    assert (spec.training.precision, spec.communication.grad_accum_dtype) == ("bf16", "fp32")
    assert load_spec(path, overrides=["training.precision=float16"]).training.precision == "fp16"


def test_planner_five_key_spec_is_valid(write_spec):
    raw = {"model": {"builtin": "llama3-70b"}, "cluster": {"nodes": 8, "gpus_per_node": 8, "gpu": "h100-80gb",
           "hosts": [f"n{i}" for i in range(8)]}, "parallel": {"tp": 8, "pp": 4, "zero_stage": 1},
           "training": {"global_batch_size": 512, "micro_batch_size": 1, "seq_length": 4096}, "data": {}}
    assert load_spec(write_spec(raw)).parallel.pp == 4


def test_json_spec_loads(tmp_path):
    path = tmp_path / "job.json"
    path.write_text(json.dumps(tiny_spec()))
    assert load_spec(path).cluster.device == "cpu"


def test_unknown_keys_all_reported_with_nearest_name(write_spec):
    raw = tiny_spec(parallel={"zero_stag": 2}, cluster={"hostz": ["a"]})
    raw["trainig"] = {}
    with pytest.raises(SpecError) as info:
        load_spec(write_spec(raw))
    problems = info.value.report.problems
    assert [p.rule for p in problems] == ["unknown_key"] * 3
    fixes = " ".join(p.fix for p in problems)
    assert "'parallel.zero_stage'" in fixes and "'cluster.hosts'" in fixes and "'training'" in fixes


def test_overrides_parse_values_as_yaml():
    raw = apply_overrides({"parallel": {"tp": 1}}, overrides=["parallel.tp=4", "cluster.hosts=[a, b]",
                                                             "parallel.sequence_parallel=true", "data.path="])
    assert raw == {"parallel": {"tp": 4, "sequence_parallel": True}, "cluster": {"hosts": ["a", "b"]},
                   "data": {"path": None}}


@pytest.mark.parametrize("bad", ["parallel.tp", "=4", "parallel..tp=4"])
def test_malformed_override_is_an_error(bad):
    with pytest.raises(DsmtError, match="section.key=value"):
        apply_overrides({}, overrides=[bad])


def test_override_unknown_key_is_named(write_spec):
    with pytest.raises(SpecError, match="parallel.tp"):
        load_spec(write_spec(tiny_spec()), overrides=["parallel.tpp=2"])


def test_schema_rules_list_is_complete():
    from toolkit.spec import data_schema, preference, sections

    source = "".join(Path(module.__file__).read_text() for module in (schema, data_schema, preference, sections))
    raised = set(re.findall(r'PydanticCustomError\(\s*"(\w+)"', source))
    assert raised == set(schema.SCHEMA_RULES)


def test_spec_and_generate_import_without_heavy_frameworks():
    # the parser imports every command module (toolkit.data.cli included: toolkit/data/__init__.py is lazy)
    code = ("import sys, toolkit.check.cli, toolkit.check.checks, toolkit.generate.writer, toolkit.cli; "
            "toolkit.cli.build_parser(); print(sorted(m for m in ('torch', 'deepspeed', 'megatron', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _alias_bomb(levels: int = 9) -> str:
    """A spec whose seq_length is 9**levels 'x' through nested aliases (9 levels: 387 million; 462 bytes)."""
    lines = ["model: {builtin: llama3-8b}", "anchors:"]
    for level in range(levels):
        items = ["x"] * 9 if level == 0 else [f"*a{level - 1}"] * 9
        lines.append(f"  a{level}: &a{level} [{', '.join(items)}]")
    return "\n".join(lines + [f"training: {{seq_length: *a{levels - 1}}}"]) + "\n"


@pytest.mark.parametrize("command", ["check", "generate"])
def test_a_yaml_alias_bomb_is_refused_before_it_expands(tmp_path, capsys, command):
    """Before: `dsmt check` spent 105 s and 4 GB printing the expanded value, `dsmt generate` panicked in
    pydantic-core. Any alias is refused at parse time, naming its line and the fix."""
    from toolkit.cli import main as dsmt

    path = tmp_path / "bomb.yaml"
    path.write_text(_alias_bomb())
    argv = [command, str(path)] + (["--out", str(tmp_path / "run")] if command == "generate" else [])
    assert dsmt(argv) == 2
    err = capsys.readouterr().err
    assert f"[yaml_alias] {path} line 4: alias *a0" in err and "fix: write the values out" in err
    assert not (tmp_path / "run").exists()


def test_spec_size_and_depth_are_bounded(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("model: {builtin: llama3-8b}\n" + "#" * (1 << 20))
    with pytest.raises(DsmtError, match=r"^\[spec_too_large\] job spec .*big.yaml is larger than 1,048,576 bytes"):
        load_spec(big)
    deep = tmp_path / "deep.yaml"
    deep.write_text("model: " + "[" * 1000 + "]" * 1000 + "\n")
    with pytest.raises(DsmtError, match=r"^\[spec_too_deep\]"):
        load_spec(deep)
    with pytest.raises(DsmtError, match=r"\[yaml_alias\] --set 'cluster.hosts=\[&h a, \*h\]' line 1: alias \*h"):
        apply_overrides({}, overrides=["cluster.hosts=[&h a, *h]"])


def test_a_wrong_value_is_shown_cut(write_spec):
    with pytest.raises(SpecError) as info:
        load_spec(write_spec(tiny_spec(training={"seq_length": list(range(2000))})))
    (problem,) = info.value.report.problems
    assert problem.rule == "bad_value" and len(problem.message) < 400 and "(10,890 characters)" in problem.message
