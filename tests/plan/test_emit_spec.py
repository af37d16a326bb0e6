"""`dsmt plan --emit-spec` writes a spec the rest of dsmt runs as is: `dsmt check` passes it, `dsmt train --dry-run`
accepts what check accepts (sequence parallelism and cp included), and the run directory `dsmt generate` writes from
it matches it (`dsmt train --run-dir DIR --dry-run`)."""

from pathlib import Path

import pytest
import yaml

from toolkit.cli import main as dsmt

PLANS = {  # model, nodes, gpus per node, gpu, seq, global batch (+ extra flags)
    "llama3-8b-1x8-h100": ["llama3-8b", "1", "8", "h100-80gb", "4096", "64"],
    "llama3-70b-8x8-h100": ["llama3-70b", "8", "8", "h100-80gb", "4096", "1024"],
    "llama3.2-1b-2x4-a100-40gb": ["llama3.2-1b", "2", "4", "a100-40gb", "2048", "64"],
    "mistral-7b-2x4-a100-40gb": ["mistral-7b", "2", "4", "a100-40gb", "4096", "64"],  # tp=4 with sp
    "llama2-70b-4x8-a100-80gb": ["llama2-70b", "4", "8", "a100-80gb", "4096", "512"],  # pp=2
    "llama3-8b-128k-8x8-h100": ["llama3-8b", "8", "8", "h100-80gb", "131072", "64"],  # long sequences
    "qwen2-72b-2x8-a100-40gb-offload": ["qwen2-72b", "2", "8", "a100-40gb", "4096", "128", "--allow-offload"],
    "tiny-llama-1x2-a100-40gb": ["tiny-llama", "1", "2", "a100-40gb", "256", "8"],
}
# The planner emits cp=1 today; an emitted spec edited to cp=2 (which `dsmt check` accepts) must train the same way.
EDITED = {"llama3-8b-1x8-h100-cp2": ("llama3-8b-1x8-h100", ["parallel.cp=2", "parallel.tp=2",
                                                              "parallel.sequence_parallel=true"])}

# The planner has no CPU preset (toolkit/plan/hardware.py GPU_PRESETS), so the CPU tiny case cannot be planned.
# A GPU whose figures are overridden ("<preset>*" / "custom") is not a preset a spec can name: refused by name.
CUSTOM_GPU = {
    "h100-80gb-with-60gb": ["llama3-8b", "1", "8", "h100-80gb", "4096", "64", "--gpu-mem-gb", "60"],
}


def emit(args: list[str], path: Path) -> dict:
    model, nodes, gpus, gpu, seq, batch, *extra = args
    assert dsmt(["plan", model, "--nodes", nodes, "--gpus-per-node", gpus, "--gpu", gpu, "--seq-len", seq,
                 "--global-batch", batch, "--emit-spec", str(path), *extra]) == 0
    return yaml.safe_load(path.read_text())


def _output(capsys) -> str:
    captured = capsys.readouterr()
    return captured.out + captured.err


@pytest.mark.parametrize("name", sorted(PLANS) + sorted(EDITED))
def test_emitted_spec_passes_check_dry_run_and_its_run_dir(name, tmp_path, capsys):
    path = tmp_path / "job.yaml"
    plan, edits = EDITED.get(name, (name, []))
    spec = emit(PLANS[plan], path)
    for edit in edits:
        section_key, value = edit.split("=")
        section, key = section_key.split(".")
        spec[section][key] = yaml.safe_load(value)
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    capsys.readouterr()
    assert dsmt(["check", str(path)]) == 0, _output(capsys)
    check_text = _output(capsys)
    assert dsmt(["train", str(path), "--dry-run"]) == 0, f"dsmt check said:\n{check_text}\n" + _output(capsys)
    dry_text = _output(capsys)
    assert "[model_build] megatron-core GPTModel built" in dry_text and "accepts ds_config" in dry_text, dry_text
    parallel = spec["parallel"]
    assert f"tp={parallel['tp']} pp={parallel['pp']}" in dry_text  # the layout the planner chose was built

    run = tmp_path / "run"
    assert dsmt(["generate", str(path), "--out", str(run)]) == 0, _output(capsys)
    capsys.readouterr()
    assert dsmt(["train", "--run-dir", str(run), "--dry-run"]) == 0, _output(capsys)
    assert "ds_config.json and megatron.json match the spec" in _output(capsys)


@pytest.mark.parametrize("name", sorted(CUSTOM_GPU))
def test_emit_spec_with_overridden_gpu_figures_is_refused_by_name(name, tmp_path, capsys):
    """A spec names a GPU preset and `dsmt check` fits memory to it; figures given on the command line have no place
    in a spec, so --emit-spec refuses (exit 2) instead of writing a spec check would refuse or misjudge."""
    model, nodes, gpus, gpu, seq, batch, *extra = CUSTOM_GPU[name]
    path = tmp_path / "job.yaml"
    assert dsmt(["plan", model, "--nodes", nodes, "--gpus-per-node", gpus, "--gpu", gpu, "--seq-len", seq,
                 "--global-batch", batch, "--emit-spec", str(path), *extra]) == 2
    assert "--emit-spec needs a GPU preset" in capsys.readouterr().err
    assert not path.exists() and list(tmp_path.iterdir()) == []
