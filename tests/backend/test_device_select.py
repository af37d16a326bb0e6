"""Each rank uses its own GPU, and the spec's device must be the machine's: CUDA mocked on a CPU machine.

The mocks record the order of calls, so these fail on code that builds every rank on cuda:0 (no
`torch.cuda.set_device`, no `device_id`), that sets the device only after the process group exists, or that falls
back to the CPU when the spec asks for CUDA."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml

from toolkit import backend as backends
from toolkit.errors import DsmtError
from toolkit.parallel.groups import Layout, init_process_groups

LAUNCHER_VARS = ("LOCAL_RANK", "SLURM_LOCALID", "WORLD_SIZE", "RANK")
REPO = Path(__file__).resolve().parents[2]


def cuda_spec(output_dir: Path) -> dict:
    """A valid one-GPU spec of a tiny inline model (what a GPU node would run)."""
    return {
        "model": {"config": {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                             "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256,
                             "hidden_act": "silu", "max_position_embeddings": 128}},
        "cluster": {"gpus_per_node": 1, "gpu": "h100-80gb", "device": "cuda"},
        "training": {"global_batch_size": 2, "micro_batch_size": 2, "seq_length": 32, "precision": "bf16",
                     "train_steps": 2, "warmup_steps": 0, "checkpoint_interval": 2, "output_dir": str(output_dir)},
        "data": {"path": str(REPO / "examples" / "data" / "tiny_stories.jsonl")},
    }


@pytest.fixture
def clean_env(monkeypatch):
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(backends, "_rank_device", None)
    return monkeypatch


@pytest.fixture
def calls(clean_env):
    """Every CUDA device call and process-group call, in order (process group and megatron groups mocked)."""
    from megatron.core import parallel_state

    recorded = []
    clean_env.setattr(dist, "is_initialized", lambda: False)
    clean_env.setattr(dist, "init_process_group", lambda **kw: recorded.append(("init_process_group", kw)))
    clean_env.setattr(dist, "get_world_size", lambda: 4)
    clean_env.setattr(parallel_state, "initialize_model_parallel", lambda **kw: recorded.append(("megatron_groups", kw)))
    return recorded


@pytest.fixture
def fake_cuda(calls, clean_env):
    """A node with 4 GPUs: current() becomes the CUDA backend for the test, the CPU one again after it."""
    clean_env.setattr(torch.cuda, "is_available", lambda: True)
    clean_env.setattr(torch.cuda, "device_count", lambda: 4)
    clean_env.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    backends.current.cache_clear()
    yield calls
    backends.current.cache_clear()


@pytest.mark.parametrize("local_rank", [0, 1, 2, 3])
def test_each_rank_selects_its_gpu_before_the_process_group_and_binds_it(fake_cuda, clean_env, local_rank):
    clean_env.setenv("LOCAL_RANK", str(local_rank))
    clean_env.setenv("WORLD_SIZE", "4")
    init_process_groups(layout=Layout(tp=4), dist_backend="nccl")
    names = [name for name, _ in fake_cuda]
    assert names == ["set_device", "init_process_group", "megatron_groups"], fake_cuda
    assert fake_cuda[0][1] == local_rank
    assert fake_cuda[1][1]["device_id"] == torch.device("cuda", local_rank)
    assert fake_cuda[1][1]["backend"] == "nccl"
    # What the model build, megatron buffers and the verify inputs then use (toolkit/adapters/build.py).
    assert backends.current().device == torch.device("cuda", local_rank)


def test_slurm_localid_is_the_fallback_and_lone_processes_use_gpu_0(fake_cuda, clean_env):
    assert backends.use_rank_device() == torch.device("cuda", 0)  # no launcher: a lone process
    clean_env.setenv("SLURM_LOCALID", "3")
    assert backends.use_rank_device() == torch.device("cuda", 3)
    clean_env.setenv("LOCAL_RANK", "1")  # the launcher's own variable wins
    assert backends.use_rank_device() == torch.device("cuda", 1)
    assert [call for call in fake_cuda if call[0] == "set_device"] == [("set_device", 0), ("set_device", 3), ("set_device", 1)]


def test_local_rank_beyond_the_node_gpus_is_a_named_error(fake_cuda, clean_env):
    clean_env.setenv("LOCAL_RANK", "4")
    with pytest.raises(backends.DeviceError) as err:
        init_process_groups(layout=Layout(tp=4), dist_backend="nccl")
    message = str(err.value)
    assert "local rank 4" in message and "4 visible GPU(s)" in message and "at most 4 processes per node" in message
    assert fake_cuda == []  # neither a device nor a process group


def test_several_ranks_without_a_local_rank_is_a_named_error(fake_cuda, clean_env):
    clean_env.setenv("WORLD_SIZE", "8")
    with pytest.raises(backends.DeviceError, match="WORLD_SIZE=8 but neither LOCAL_RANK nor SLURM_LOCALID"):
        backends.use_rank_device()
    assert fake_cuda == []


def test_model_build_puts_the_chunks_on_the_ranks_own_gpu(fake_cuda, clean_env):
    """build_model_chunks moves each chunk to `Backend.device`: cuda:2 on local rank 2 (cuda:0 before the fix)."""
    from megatron.core import parallel_state
    from megatron.core.models import gpt

    from toolkit.adapters import build
    from toolkit.adapters.hf_config import model_settings
    from toolkit.models.tiny import tiny_config

    moved_to = []

    class FakeGPTModel(torch.nn.Module):
        def __init__(self, **kwargs):
            super().__init__()
            self.pre_process = self.post_process = False  # no embedding or output layer to hook

        def to(self, device):
            moved_to.append(device)
            return self

    clean_env.setattr(gpt, "GPTModel", FakeGPTModel)
    clean_env.setattr(build, "transformer_config", lambda **kw: None)
    clean_env.setattr(build, "layer_spec", lambda **kw: None)
    clean_env.setattr(build, "decoder_spec", lambda **kw: None)
    clean_env.setattr(parallel_state, "is_pipeline_first_stage", lambda **kw: True)
    clean_env.setattr(parallel_state, "is_pipeline_last_stage", lambda **kw: True)
    clean_env.setenv("LOCAL_RANK", "2")
    init_process_groups(layout=Layout(tp=4), dist_backend="nccl")
    build.build_model_chunks(settings=model_settings(tiny_config("llama")), layout=Layout(tp=4))
    assert moved_to == [torch.device("cuda", 2)]


def test_verify_worker_selects_the_device_before_its_process_group(fake_cuda, clean_env, tmp_path):
    import toolkit.parallel.groups
    from toolkit.verify import worker

    class Stop(Exception):
        pass

    def fake_init(**kwargs):
        fake_cuda.append(("init_process_groups", kwargs))
        raise Stop

    clean_env.setattr(toolkit.parallel.groups, "init_process_groups", fake_init)
    clean_env.setenv("LOCAL_RANK", "1")
    with pytest.raises(Stop):
        worker.main(["--checkpoint", str(tmp_path), "--tp", "2", "--result-file", str(tmp_path / "r.json")])
    assert [name for name, _ in fake_cuda] == ["set_device", "init_process_groups"]
    assert fake_cuda[0][1] == 1 and fake_cuda[1][1]["dist_backend"] == "nccl"


def test_spec_cuda_without_cuda_is_refused(clean_env):
    clean_env.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(backends.DeviceError) as err:
        backends.select(device="cuda")
    assert isinstance(err.value, DsmtError) and err.value.exit_code == 2
    message = str(err.value)
    assert "cluster.device=cuda but CUDA is not available" in message
    assert "cluster.device: cpu and cluster.gpu: cpu" in message and "CUDA_VISIBLE_DEVICES" in message


def test_spec_cpu_on_a_cuda_machine_is_refused_not_run_on_the_gpu(fake_cuda):
    with pytest.raises(backends.DeviceError, match=r"cluster.device=cpu but this machine has CUDA \(4 GPU\(s\)"):
        backends.select(device="cpu")


def test_matching_spec_device_gives_the_detected_backend(fake_cuda):
    assert backends.select(device="cuda").name == "cuda"


def test_train_refuses_a_cuda_spec_on_this_cpu_machine_before_any_process_group(clean_env, calls, tmp_path):
    """`train()`'s first step; before the fix it trained on the CPU with gloo."""
    import toolkit.parallel.groups
    from toolkit.spec.schema import JobSpec
    from toolkit.check.job import job_of
    from toolkit.errors import Report
    from toolkit.train.job.run import train

    clean_env.setattr(torch.cuda, "is_available", lambda: False)
    clean_env.setattr(toolkit.parallel.groups, "init_process_groups", lambda **kw: calls.append(("init_process_groups", kw)))
    spec = JobSpec.model_validate(cuda_spec(tmp_path / "out"))
    with pytest.raises(backends.DeviceError, match="cluster.device=cuda"):
        train(job=job_of(spec=spec, report=Report(source="test", problems=())))
    assert calls == []


def test_train_entry_point_exits_2_naming_the_device(tmp_path):
    """What a launcher sees on a GPU node whose CUDA is broken (here: a CPU machine given a CUDA spec)."""
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(cuda_spec(tmp_path / "out")))
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS} | {"PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-m", "toolkit.train", "--config", str(path)], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=300)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-3000:]
    assert "cluster.device=cuda but CUDA is not available" in done.stderr
    assert not (tmp_path / "out").exists()


def test_on_the_cpu_nothing_cuda_is_called(calls, clean_env):
    def no_cuda(*args, **kwargs):
        raise AssertionError("a CUDA call on the CPU backend")

    backends.current.cache_clear()
    assert backends.current().name == "cpu"
    clean_env.setattr(torch.cuda, "set_device", no_cuda)
    clean_env.setattr(torch.cuda, "device_count", no_cuda)
    clean_env.setenv("LOCAL_RANK", "3")
    assert backends.select(device="cpu").name == "cpu"
    init_process_groups(layout=Layout(tp=4), dist_backend="gloo")
    assert [name for name, _ in calls] == ["init_process_group", "megatron_groups"]
    assert "device_id" not in calls[0][1] and calls[0][1]["backend"] == "gloo"
    assert backends.current().device == torch.device("cpu")


def test_megatron_makes_no_gloo_groups_dsmt_never_uses(fake_cuda, clean_env):
    """megatron's gloo copies of the DP groups are one more rendezvous each over the hostname's interface (a
    multi-node hang where it resolves to the wrong one); dsmt's DeepSpeed reduction never uses them."""
    clean_env.setenv("LOCAL_RANK", "0")
    clean_env.setenv("WORLD_SIZE", "4")
    init_process_groups(layout=Layout(tp=2, pp=2), dist_backend="nccl")
    megatron_kwargs = dict(fake_cuda)["megatron_groups"]
    assert megatron_kwargs["create_gloo_process_groups"] is False


@pytest.mark.parametrize("tp", [1, 2])
def test_dsmt_train_launches_with_the_generated_scripts_environment(fake_cuda, clean_env, tmp_path, tp):
    """`dsmt train` on a GPU box exports what `dsmt generate` writes to .deepspeed_env: the NCCL presets, and
    CUDA_DEVICE_MAX_CONNECTIONS=1 where megatron's TP communication needs ordered kernel launches."""
    import toolkit.launch.local
    from toolkit.generate.env import environment
    from toolkit.spec.schema import JobSpec
    from toolkit.train.job import launch as train_launch

    spec_fields = cuda_spec(tmp_path / "out")
    spec_fields["cluster"]["gpus_per_node"] = 4
    spec_fields["parallel"] = {"tp": tp}
    spec_fields["training"]["global_batch_size"] = 2 * 4 // tp
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec_fields))
    launched = {}
    clean_env.setattr(toolkit.launch.local, "launch_local_workers", lambda **kw: launched.update(kw))
    # The pre-launch pass builds the model on a fake process group, which this test's mocked dist cannot serve
    # (tests/check/test_prelaunch.py runs it); the job `dsmt check`'s checks make of it.
    from toolkit.check.job import check_job_file

    train_launch.launch_training(job=check_job_file(path), spec_file=path)
    expected = environment(spec=JobSpec.model_validate(spec_fields))
    from toolkit.launch.run_lock import LOCK_ENV, lock_path

    assert launched["env"] == {**expected, LOCK_ENV: str(lock_path(tmp_path / "out"))}  # and the run lock's path
    assert expected["NCCL_DEBUG"] and expected["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert expected.get("CUDA_DEVICE_MAX_CONNECTIONS") == ("1" if tp > 1 else None)
