"""What a model folder or a full disk cannot do to dsmt: run the folder's Python code (auto_map), smuggle a file from
outside the folder into a converted checkpoint (a symlinked side file), leave a traceback and half an output
(ENOSPC), or leave a killed conversion's temporary folder behind for good."""

import errno
import io
import json
import os
import re
import shutil
import subprocess
import sys
import types

import pytest
import yaml

from toolkit.cli import main as dsmt
from toolkit.models.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("hf") / "llama")


def folder_with_code(llama, tmp_path, *, config_file: str, module: str, changes: dict):
    """A copy of `llama` whose `config_file` names `module`.py in auto_map (with `changes`); the module, if
    imported, creates tmp_path/MARKER."""
    folder = tmp_path / "evil"
    shutil.copytree(llama, folder)
    config = json.loads((folder / config_file).read_text())
    (folder / config_file).write_text(json.dumps({**config, **changes}))
    (folder / f"{module}.py").write_text(f"open({str(tmp_path / 'MARKER')!r}, 'w').write('ran')\n")
    return folder


def write_job(tmp_path, model_path) -> str:
    spec = {"model": {"path": str(model_path)},
            "cluster": {"gpus_per_node": 1, "gpu": "cpu", "device": "cpu", "interconnect": "tcp"},
            "training": {"global_batch_size": 2, "micro_batch_size": 1, "seq_length": 32, "precision": "fp32",
                         "train_steps": 2, "warmup_steps": 1, "checkpoint_interval": 2,
                         "output_dir": str(tmp_path / "out")},
            "data": {"synthetic": True}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    return str(tmp_path / "job.yaml")


def test_a_folder_with_its_own_config_code_is_refused_though_stdin_says_yes(llama, tmp_path, monkeypatch, capsys):
    """Before: `dsmt train --dry-run` let transformers ask on stdin, and a `y` ran configuration_evil.py."""
    auto_map = {"AutoConfig": "configuration_evil.EvilConfig"}
    folder = folder_with_code(llama, tmp_path, config_file="config.json", module="configuration_evil",
                              changes={"model_type": "evil", "auto_map": auto_map})
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 10))
    job = write_job(tmp_path, folder)
    for argv in (["check", job], ["train", job, "--dry-run"], ["plan", str(folder), "--nodes", "1", "--seq-len", "32",
                 "--global-batch", "8"], ["convert", "hf-to-mcore", str(folder), str(tmp_path / "mcore")]):
        assert dsmt(argv) == 2, argv
        err = capsys.readouterr().err
        assert (f"[remote_code_refused] {folder}/config.json has auto_map (configuration_evil.py) and model_type "
                "'evil'") in err and "dsmt never runs code from a model folder" in err, argv
    assert not (tmp_path / "MARKER").exists() and not (tmp_path / "mcore").exists()


def test_a_tokenizer_with_its_own_code_is_refused_and_a_shipped_class_is_not(llama, tmp_path, monkeypatch):
    from toolkit.data.tokenize import load_tokenizer
    from toolkit.models.remote_code import RemoteCodeRefused, refuse_remote_code
    from toolkit.spec.data_schema import DataSpec

    folder = folder_with_code(llama, tmp_path, config_file="tokenizer_config.json", module="tokenization_evil",
                              changes={"tokenizer_class": "EvilTokenizer",
                                       "auto_map": {"AutoTokenizer": [None, "tokenization_evil.EvilTokenizer"]}})
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 10))
    with pytest.raises(RemoteCodeRefused, match=r"tokenizer_config.json has auto_map \(tokenization_evil.py\) and "
                                                 r"tokenizer_class 'EvilTokenizer'"):
        load_tokenizer(data=DataSpec(synthetic=True), model_path=str(folder))
    assert not (tmp_path / "MARKER").exists()
    # Phi-3 and DeepSeek-V3 as published keep an auto_map beside a model_type transformers ships: not refused
    config = json.loads((llama / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "phi3", "auto_map": {
        "AutoConfig": "configuration_phi3.Phi3Config", "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"}}))
    (folder / "tokenizer_config.json").write_text((llama / "tokenizer_config.json").read_text())
    refuse_remote_code(folder)


def test_a_side_file_linked_outside_the_folder_is_refused_and_the_hub_cache_layout_is_not(llama, tmp_path, capsys):
    """Before: merges.txt -> /etc/passwd was copied, contents and all, into the converted checkpoint."""
    folder = tmp_path / "linked"
    shutil.copytree(llama, folder)
    outside = tmp_path / "secret.txt"
    outside.write_text("not the model's\n")
    (folder / "merges.txt").symlink_to(outside)
    assert dsmt(["convert", "hf-to-mcore", str(folder), str(tmp_path / "mcore"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"[side_file_outside_source] 1 file(s) of {folder} link outside it" in err
    assert f"{folder}/merges.txt -> {outside}" in err and not (tmp_path / "mcore").exists()
    # the HF hub cache: snapshots/<revision>/<file> -> ../../blobs/<hash>, inside the model's cache folder
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for index, path in enumerate(sorted(llama.iterdir())):
        shutil.copy2(path, repo / "blobs" / f"blob{index}")
        (snapshot / path.name).symlink_to(f"../../blobs/blob{index}")
    assert dsmt(["convert", "hf-to-mcore", str(snapshot), str(tmp_path / "cached"), "--quiet"]) == 0
    copied = tmp_path / "cached" / "hf" / "tokenizer.json"
    assert not copied.is_symlink() and copied.read_text() == (llama / "tokenizer.json").read_text()


def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_is_named_and_leaves_nothing(llama, tmp_path, monkeypatch, capsys):
    """Before: a 50-line traceback ending in `OSError: [Errno 28]` (wrapped in torch's CheckpointException), exit 1.
    Both writers: torch's (hf-to-mcore) and dsmt's safetensors writer (mcore-to-hf)."""
    import torch.distributed.checkpoint.filesystem as dcp_files

    from toolkit.convert import raw_io

    assert dsmt(["convert", "hf-to-mcore", str(llama), str(tmp_path / "mcore"), "--quiet"]) == 0
    for direction, source, target, writer in (("hf-to-mcore", llama, "mcore2", (dcp_files, "_write_item")),
                                              ("mcore-to-hf", tmp_path / "mcore", "back", (raw_io, "pwrite_from"))):
        with monkeypatch.context() as patch:
            patch.setattr(*writer, no_space)
            assert dsmt(["convert", direction, str(source), str(tmp_path / target), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"dsmt convert: error: [disk_full] the disk filled while writing {tmp_path / target} (")
        assert re.search(r"; the output needs about \d+\.\d MB\); nothing of it was kept \(the library said: "
                         r"OSError: \[Errno 28\] No space left on device\)\nfix: free space on the filesystem of ", err)
        assert "Traceback" not in err and sorted(p.name for p in tmp_path.iterdir()) == ["mcore"]
    # too little free space: refused before the first byte, with what is needed and what is free
    monkeypatch.setattr(shutil, "disk_usage", lambda path: types.SimpleNamespace(total=10**9, used=10**9, free=1000))
    assert dsmt(["convert", "mcore-to-hf", str(tmp_path / "mcore"), str(tmp_path / "back"), "--quiet"]) == 2
    back, parent = re.escape(str(tmp_path / "back")), re.escape(str(tmp_path))
    assert re.search(rf"\[disk_full\] {back} needs about \d+\.\d MB \(the tensors it holds\) and {parent} has 0.0 MB "
                     r"free; nothing was written\n", capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mcore"]


def test_a_killed_conversions_temporary_is_removed_by_the_next(llama, tmp_path, capsys):
    """Before: `.NAME.partial-PID` (248 MB in the report) stayed after a killed `dsmt convert`, for good."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a process id that is surely gone
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stale, running = tmp_path / f".mcore.partial-{dead.pid}", tmp_path / f".mcore.partial-{alive.pid}"
        for folder in (stale, running):
            (folder / "model").mkdir(parents=True)
            (folder / "model" / "__0_0.distcp").write_bytes(b"\0" * 300_000)
        assert dsmt(["convert", "hf-to-mcore", str(llama), str(tmp_path / "mcore"), "--quiet"]) == 0
        assert (f"removed {stale} (0.3 MB): left by a killed write of {tmp_path / 'mcore'} (process {dead.pid})"
                in capsys.readouterr().err)
        assert not stale.exists() and running.exists()  # another conversion's, still running: not touched
    finally:
        alive.kill()
        alive.wait()


def test_links_into_a_hub_blob_store_are_the_checkpoints_own_and_the_dry_run_names_an_outside_link(tmp_path):
    """A `--local-dir` download of older huggingface_hub links big files into the cache's blobs, and a model may sit
    in a snapshot's subfolder: both are the checkpoint's own files. A link elsewhere is named before training (the
    export would otherwise refuse it after the last step)."""
    from toolkit.convert.checkpoint import side_files
    from toolkit.spec.load import validate_spec
    from toolkit.check.dryrun import side_file_problems

    blobs = tmp_path / "hub" / "models--org--tiny" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / "abc123").write_text("{}")
    local = tmp_path / "local"
    local.mkdir()
    (local / "tokenizer.json").symlink_to(blobs / "abc123")
    sub = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "rev" / "sub"
    sub.mkdir(parents=True)
    (sub / "tokenizer.json").symlink_to("../../../blobs/abc123")
    assert side_files(local) == ["tokenizer.json"] and side_files(sub) == ["tokenizer.json"]
    (tmp_path / "secret.txt").write_text("not the model's\n")
    (local / "merges.txt").symlink_to(tmp_path / "secret.txt")
    spec = validate_spec({"model": {"path": str(local)}, "data": {"synthetic": True}}, source="x")
    [problem] = side_file_problems(spec=spec)
    assert problem.rule == "side_file_outside_source" and f"{local}/merges.txt -> {tmp_path}/secret.txt" in problem.message
