"""Generated files say every value they change relative to the spec, and why (issue 46 item 6): summary.txt's
`adjusted` lines, job.resolved.yaml kept as the spec given; the paths notes; cluster.slurm in job.sbatch (values
refused by rule, the script parsed by bash and run against stand-in SLURM commands); api.generate's paths."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from gen_helpers import VARIANTS, _gpu_variant, render, spec_of
from toolkit import api
from toolkit.generate.adjustments import JSON_MIRRORS, run_file_adjustments
from toolkit.generate.deepspeed_config import build_deepspeed_config
from toolkit.generate.megatron_settings import build_megatron_settings
from toolkit.spec.layout import derive_layout
from toolkit.spec.load import load_spec, model_shape, validate_spec
from toolkit.errors import SpecError

# Spec fields the run files carry as given, whatever the layout: a difference here would be a silent adjustment
# (add it to JSON_MIRRORS with its reason instead). spec field -> (file, dotted key).
CARRIED_AS_GIVEN = {
    "parallel.tp": ("megatron.json", "transformer_config.tensor_model_parallel_size"),
    "parallel.pp": ("megatron.json", "transformer_config.pipeline_model_parallel_size"),
    "parallel.cp": ("megatron.json", "transformer_config.context_parallel_size"),
    "parallel.sequence_parallel": ("megatron.json", "transformer_config.sequence_parallel"),
    "parallel.zero_stage": ("ds_config.json", "zero_optimization.stage"),
    "training.micro_batch_size": ("ds_config.json", "train_micro_batch_size_per_gpu"),
    "training.seq_length": ("megatron.json", "schedule.seq_length"),
    "training.grad_clip": ("ds_config.json", "gradient_clipping"),
    "training.lr": ("ds_config.json", "optimizer.params.lr"),
    "training.weight_decay": ("ds_config.json", "optimizer.params.weight_decay"),
    "training.adam_eps": ("ds_config.json", "optimizer.params.eps"),
    "training.seed": ("megatron.json", "layout.seed"),
    "communication.contiguous_gradients": ("ds_config.json", "zero_optimization.contiguous_gradients"),
    "communication.reduce_scatter": ("ds_config.json", "zero_optimization.reduce_scatter"),
    "communication.reduce_bucket_elements": ("ds_config.json", "zero_optimization.reduce_bucket_size"),
    "communication.allgather_bucket_elements": ("ds_config.json", "zero_optimization.allgather_bucket_size"),
    "communication.prefetch_bucket_elements": ("ds_config.json", "zero_optimization.stage3_prefetch_bucket_size"),
    "communication.param_persistence_threshold_elements": (
        "ds_config.json", "zero_optimization.stage3_param_persistence_threshold"),
    "communication.communication_data_type": ("ds_config.json", "communication_data_type"),
}


def _at(tree, dotted):
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return KeyError
        tree = tree[part]
    return tree


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_value_a_run_file_changes_is_listed_with_its_reason(name):
    files = render(name)
    spec = spec_of(name).model_dump()
    built = {file_name: json.loads(files[file_name]) for file_name in ("ds_config.json", "megatron.json")}
    for setting, (file_name, key) in CARRIED_AS_GIVEN.items():
        carried = _at(built[file_name], key)
        if _at(spec, setting) is not None and carried is not KeyError:
            assert carried == _at(spec, setting), f"{name}: {setting} silently becomes {carried} in {file_name}"
    for setting, (file_name, key, reason) in JSON_MIRRORS.items():
        given, carried = _at(spec, setting), _at(built[file_name], key)
        if given is not None and carried is not KeyError and carried != given:
            assert f"{setting}: spec {json.dumps(given) if not isinstance(given, str) else given} -> " in \
                files["summary.txt"] and reason in files["summary.txt"], (name, setting)


def test_pp2_summary_says_why_overlap_comm_is_off_and_the_resolved_spec_keeps_it():
    files = render("slurm-pp2-site")
    assert json.loads(files["ds_config.json"])["zero_optimization"]["overlap_comm"] is False
    assert yaml.safe_load(files["job.resolved.yaml"])["communication"]["overlap_comm"] is True  # the spec as given
    assert ("communication.overlap_comm: spec true -> false in ds_config.json zero_optimization.overlap_comm: "
            "DeepSpeed allows no overlap when megatron's pipeline schedule drives the reduction (pp > 1)\n"
            in files["summary.txt"])
    assert "summary.txt lists every adjustment" in files["job.resolved.yaml"].split("\nmodel:")[0]
    assert "adjusted   3 value(s) differ from job.resolved.yaml" in files["summary.txt"]


def test_a_spec_carried_as_given_says_so():
    assert "\nadjusted   none: the run files carry every spec value" in render("tiny-cpu")["summary.txt"]


def _tiny(**sections) -> dict:
    raw = {key: dict(value) if isinstance(value, dict) else value for key, value in VARIANTS["tiny-cpu"].items()}
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return raw


@pytest.mark.parametrize("raw,expected", [
    (_gpu_variant(parallel={"cp": 2}), "training.global_batch_size: spec 128 -> 256 in ds_config.json "
                                       "train_batch_size: DeepSpeed's data-parallel group is dp x cp (8 x 2)"),
    (_tiny(communication={"grad_accum_dtype": "bf16"}), "communication.grad_accum_dtype: spec bf16 -> fp32 in "
                                                        "ds_config.json data_types.grad_accum_dtype: precision fp32"),
    (_gpu_variant(parallel={"pp": 2, "vpp": 1}), "parallel.vpp: spec 1 -> null in megatron.json"),
    (_gpu_variant(communication={"extra_env": {"NCCL_DEBUG": "INFO"}}),
     "NCCL_DEBUG: preset WARN -> INFO in .deepspeed_env: communication.extra_env sets it"),
    (_gpu_variant(cluster={"interconnect": "tcp"}, communication={"nccl_ib_hca": "mlx5_0"}),
     "communication.nccl_ib_hca: spec mlx5_0 -> not written in .deepspeed_env: no InfiniBand"),
    (_tiny(cluster={"launcher": "openmpi", "network_interface": "eth0"}),
     "cluster.network_interface: spec eth0 -> lo in launch_deepspeed.sh (mpirun --mca btl_tcp_if_include): one node"),
])
def test_each_kind_of_adjustment_has_its_line(raw, expected):
    """The builders directly (no checks: a cp=2 spec needs a GPU's attention to pass them)."""
    spec = validate_spec(raw, source="test")
    layout = derive_layout(spec)
    lines = [adjustment.line() for adjustment in run_file_adjustments(
        spec=spec, layout=layout, ds_config=build_deepspeed_config(spec=spec, layout=layout),
        megatron=build_megatron_settings(spec=spec, layout=layout, shape=model_shape(spec.model)))]
    assert any(line.startswith(expected) for line in lines), lines


def test_summary_and_scripts_say_the_paths_are_this_machines():
    files = render("slurm-pp2-site")
    assert ("paths      run directory /RUN_DIR, output_dir /shared/runs/llama3-8b-pp2\n           paths are absolute "
            "paths of the machine that generated this directory: the run directory\n           and output_dir must be "
            "at the same path on every node (a shared filesystem)\n") in files["summary.txt"]
    for script in ("job.sbatch", "launch_deepspeed.sh", "launch_torchrun.sh"):
        comments = files[script].replace("\n# ", " ")
        assert "of the machine that generated this directory" in comments and "(a shared filesystem)" in comments
    assert "--templates site-templates/" in files["job.sbatch"]  # the route for what cluster.slurm lacks


@pytest.mark.parametrize("slurm,rule", [
    ({"account": "proj\\42"}, "slurm_value"),  # sbatch's parser drops a backslash, even inside quotes
    ({"partition": "gpu\tlong"}, "slurm_value"),
    ({"qos": "high\nrm -rf /"}, "slurm_value"),
    ({"time": "24h"}, "slurm_time"),
    ({"time": "1-00:61:00"}, "slurm_time"),
    ({"extra_sbatch": ["--comment=a\\b"]}, "sbatch_option"),
    ({"extra_sbatch": ["--account=other"]}, "sbatch_option"),
    ({"setup": ["module load cuda\nrm -rf /"]}, "slurm_line"),
    ({"srun_args": [""]}, "slurm_line"),
])
def test_a_bad_slurm_value_is_refused_with_its_rule(slurm, rule):
    raw = _gpu_variant(cluster={"hosts": "slurm", "slurm": slurm})
    with pytest.raises(SpecError) as caught:
        validate_spec(raw, source="test")
    assert caught.value.report.rules() == {rule}
    assert f"cluster.slurm.{next(iter(slurm))}" in caught.value.report.to_text()


@pytest.mark.parametrize("name", ["slurm-pp2-site", "slurm-site-extras", "tiny-cpu"])
def test_job_sbatch_parses(name, tmp_path):
    (tmp_path / "job.sbatch").write_text(render(name)["job.sbatch"])
    result = subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _stand_in(bin_dir: Path, name: str, body: str) -> None:
    (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
    (bin_dir / name).chmod(0o755)


def test_job_sbatch_runs_setup_in_the_submit_dir_then_srun_in_the_run_dir(tmp_path):
    """Stand-ins for scontrol / srun / module: setup's `source "$HOME/..."` records its directory, srun its own."""
    run, submit, home, bin_dir = (tmp_path / name for name in ("run", "submit", "home", "bin"))
    for folder in (run, submit, home / "venvs/dsmt/bin", bin_dir):
        folder.mkdir(parents=True)
    files = render("slurm-pp2-site", run_dir=str(run))
    for file_name in ("job.sbatch", ".deepspeed_env"):
        (run / file_name).write_text(files[file_name])
    (home / "venvs/dsmt/bin/activate").write_text(f'pwd > "{tmp_path}/setup_cwd"\n')
    _stand_in(bin_dir, "module", f'echo "$@" > "{tmp_path}/module_args"')
    _stand_in(bin_dir, "scontrol", 'if [[ $1 == show && $2 == hostnames ]]; then echo gpu001; else '
                                   'echo "NodeName=gpu001 NodeAddr=10.1.0.1 State=IDLE"; fi')
    _stand_in(bin_dir, "srun", f'{{ pwd; printf "%s\\n" "$@"; }} > "{tmp_path}/srun"')
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(home), "SLURM_JOB_NODELIST": "gpu001",
           "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_ID": "7"}
    result = subprocess.run(["bash", str(run / "job.sbatch")], cwd=submit, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "setup_cwd").read_text().strip() == str(submit)
    assert (tmp_path / "module_args").read_text().strip() == "load cuda/12.4"
    srun = (tmp_path / "srun").read_text().splitlines()
    assert srun[0] == str(run) and "10.1.0.1:29500" in srun and f"{run}/job.resolved.yaml" in srun


def test_api_generate_pins_relative_paths_against_the_working_directory(tmp_path, monkeypatch):
    """A relative output_dir means the same directory under sbatch (which reads job.resolved.yaml against the run
    directory) as where api.generate was called."""
    monkeypatch.chdir(tmp_path)
    spec = api.job_spec(VARIANTS["tiny-cpu"], overrides=["training.output_dir=mine"])
    api.generate(spec, out_dir=Path("run"))
    resolved = tmp_path / "run" / "job.resolved.yaml"
    assert yaml.safe_load(resolved.read_text())["training"]["output_dir"] == str(tmp_path / "mine")
    assert load_spec(resolved).training.output_dir == str(tmp_path / "mine")  # as the ranks read it back
    assert f"output_dir {tmp_path / 'mine'}\n" in (tmp_path / "run" / "summary.txt").read_text()
