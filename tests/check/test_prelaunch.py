"""Every mistake caught before a rank starts: each bad input is refused by `dsmt check`, by `dsmt train --dry-run`
and by `dsmt train` itself with the same rule, and `dsmt train` refuses it before any rank process exists (exit 2,
no output directory). The train leg runs dsmt's CLI in this process with the rank launcher replaced by a tripwire."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from toolkit import cli
from toolkit.models.tiny import make_tiny_checkpoint
from toolkit.launch import local

REPO = Path(__file__).resolve().parents[2]
PROMPTS = REPO / "examples" / "data" / "tiny_prompts.jsonl"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Llama, one with a corrupt safetensors header, one truncated, and a transformer with no adapter."""
    root = tmp_path_factory.mktemp("prelaunch-models")
    make_tiny_checkpoint(root / "llama")
    for name, damage in (("corrupt", lambda data: b"\xff" * 8 + data[8:]), ("truncated", lambda data: data[:-100])):
        shutil.copytree(root / "llama", root / name)
        weights = root / name / "model.safetensors"
        weights.write_bytes(damage(weights.read_bytes()))
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    GPTNeoXForCausalLM(GPTNeoXConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, vocab_size=250)).save_pretrained(root / "neox")
    for tokenizer_file in (root / "llama").glob("tokenizer*"):
        shutil.copy(tokenizer_file, root / "neox")
    return root


def _spec(folder: Path, *, model: dict, data: dict, parallel: dict | None = None, training: dict | None = None,
          name: str = "job.yaml") -> Path:
    raw = {"model": model, "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu": "cpu", "device": "cpu"},
           "parallel": {"tp": 1, "pp": 1, "zero_stage": 1, **(parallel or {})},
           "training": {"global_batch_size": 4, "micro_batch_size": 1, "seq_length": 32, "precision": "fp32",
                        "train_steps": 2, "output_dir": "out", **(training or {})},
           "data": data}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(yaml.safe_dump(raw))
    return folder / name


def _record_missing_completion(folder: Path) -> Path:
    lines = PROMPTS.read_text().splitlines()
    record = json.loads(lines[17])
    del record["completion"]
    lines[17] = json.dumps(record)
    (folder / "sft.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "sft.jsonl"


def _malformed_line(folder: Path) -> Path:
    """tiny_prompts.jsonl with line 40 cut short, as a hand edit leaves it."""
    lines = PROMPTS.read_text().splitlines()
    lines[39] = '{"prompt": "abc"'
    (folder / "cut.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "cut.jsonl"


def _alpaca_beyond_seq_length(folder: Path) -> Path:
    """Alpaca records whose prompt (the Stanford template around the instruction) alone exceeds seq_length 32."""
    records = [{"instruction": f"Name a colour, {i}.", "input": "", "output": "Blue."} for i in range(3)]
    (folder / "alpaca.json").write_text(json.dumps(records))
    return folder / "alpaca.json"


SFT = {"prompt_field": "prompt", "completion_field": "completion"}
DRY_RUN_ONLY = {"prompts_beyond_seq_length"}  # the records are tokenised by the dry run, not by plain `dsmt check`


def _bad_inputs(models: Path, folder: Path) -> dict[str, tuple[Path, str, str]]:
    """name -> (spec, rule, a needle every refusal carries)."""
    llama, data = {"path": str(models / "llama")}, {"path": str(PROMPTS), **SFT}
    missing_completion = _record_missing_completion(folder)
    (folder / "tiny-llama").mkdir()  # a folder named like the built-in shape
    (folder / "notes").mkdir()  # a folder that is not a model
    (folder / "notes" / "README.md").write_text("my notes\n")
    (folder / "a-file").write_text("not a directory\n")
    return {
        "corrupt_header": (_spec(folder / "a", model={"path": str(models / "corrupt")}, data=data),
                           "checkpoint_unreadable", "corrupt/model.safetensors is not a readable safetensors file"),
        "truncated_shard": (_spec(folder / "b", model={"path": str(models / "truncated")}, data=data),
                            "checkpoint_unreadable", "truncated/model.safetensors is not a readable"),
        "record_missing_field": (_spec(folder / "c", model=llama, data={"path": str(missing_completion), **SFT}),
                                 "record_missing_field", "record 18 (line 18 of"),
        "validation_record_missing_field": (_spec(folder / "h", model=llama, data={
            **data, "validation_path": str(missing_completion)}), "record_missing_field",
            "data.validation_path: " + f"{missing_completion}: record 18 (line 18 of"),
        "no_adapter_at_tp2": (_spec(folder / "d", model={"path": str(models / "neox")}, data=data,
                                    parallel={"tp": 2}), "plain_model_layout", "model_type gpt_neox has no"),
        "data_path_missing": (_spec(folder / "e", model=llama, data={"path": "nowhere.jsonl", **SFT}),
                              "data_path_missing", f"{folder / 'e' / 'nowhere.jsonl'} does not exist"),
        "wrong_field_name": (_spec(folder / "f", model=llama, data={"path": str(PROMPTS), "prompt_field": "promt",
                                                                    "completion_field": "completion"}),
                             "record_missing_field", "fields present: prompt, completion"),
        "builtin_name_and_folder": (_spec(folder, model={"path": "tiny-llama"}, data={"synthetic": True}),
                                    "model_path_ambiguous", "names both the built-in shape tiny-llama and the folder"),
        "warmup_not_below_steps": (_spec(folder / "g", model=llama, data=data, training={"warmup_steps": 2}),
                                   "warmup_vs_steps", "set training.warmup_steps to 0"),
        "output_dir_is_a_file": (_spec(folder / "i", model=llama, data=data,
                                       training={"output_dir": str(folder / "a-file")}),
                                 "output_dir_not_a_directory", f"training.output_dir={folder / 'a-file'} is a file"),
        "output_dir_inside_a_file": (_spec(folder / "j", model=llama, data=data,
                                           training={"output_dir": str(folder / "a-file" / "run")}),
                                     "output_dir_not_a_directory", f"is inside {folder / 'a-file'}, which is a file"),
        "malformed_json_line": (_spec(folder / "k", model=llama, data={"path": str(_malformed_line(folder)), **SFT}),
                                "data_json_line", "cut.jsonl': line 40 is not valid JSON (Expecting ',' delimiter"),
        "folder_not_a_model": (_spec(folder / "l", model={"path": str(folder / "notes")}, data=data), "model_shape",
                               "is a folder but not an HF checkpoint: it has no config.json (it holds README.md)"),
        "prompts_beyond_seq_length": (_spec(folder / "m", model=llama, data={
            "path": str(_alpaca_beyond_seq_length(folder)), "type": "alpaca"}), "no_loss_tokens",
            "none of the 3 prompt_completion records has a loss-bearing token within seq_length + 1 = 33 tokens: "
            "their prompts are"),
    }


def _dsmt(*args: str, capsys) -> tuple[int, str]:
    code = cli.main(list(args))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.fixture
def tripwire(monkeypatch):
    """`dsmt train` in this process, its rank launcher replaced: a call means a rank would have started."""
    started = []
    monkeypatch.setattr(local, "launch_local_workers", lambda **kwargs: started.append(kwargs))
    return started


def test_each_mistake_is_refused_by_check_dry_run_and_train_before_any_rank(models, tmp_path, capsys, tripwire):
    cases = _bad_inputs(models, tmp_path)
    for name, (spec, rule, needle) in cases.items():
        for command in (["check"], ["check", "--deep"], ["train", "--dry-run"], ["train"]):
            code, output = _dsmt(*command, str(spec), capsys=capsys)
            said = f"{name}, dsmt {' '.join(command)}:\n{output}"
            if command == ["check"] and name in DRY_RUN_ONLY:
                assert code == 0 and f"[{rule}]" not in output, said
                continue
            assert code == 2 and f"error   [{rule}]" in output and needle in output, said
            assert output.count(f"[{rule}]") == 1, said  # one line per problem, also where two checks read it
            assert output.count("error   [") == 1, said  # one mistake, one error (no tokenizer error after it)
        assert not tripwire, name
        assert not (spec.parent / "out").exists(), name  # no run directory left behind


def test_train_refuses_in_a_real_process_before_any_rank(models, tmp_path):
    spec = _spec(tmp_path, model={"path": str(models / "corrupt")}, data={"path": str(PROMPTS), **SFT})
    result = subprocess.run([sys.executable, "-m", "toolkit.cli", "train", str(spec)], cwd=REPO, text=True,
                            capture_output=True, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "[checkpoint_unreadable]" in result.stderr and "nothing was started" in result.stderr, result.stderr
    assert "node 0 of 1" not in result.stdout  # the launcher's first line
    assert not (tmp_path / "out").exists()


def test_a_running_run_is_refused_before_the_checks(models, tmp_path, capsys, tripwire, monkeypatch):
    from toolkit.check import checks, dryrun
    from toolkit.launch import run_lock

    spec = _spec(tmp_path, model={"path": str(models / "llama")}, data={"path": str(PROMPTS), **SFT})
    for module, name in ((dryrun, "prelaunch"), (dryrun, "prelaunch_pass"), (checks, "run_checks")):
        monkeypatch.setattr(module, name, lambda *args, **kwargs: pytest.fail("the checks ran"))
    with run_lock.acquire(output_dir=tmp_path / "out", command="the first run"):  # held by this live process
        code, output = _dsmt("train", str(spec), capsys=capsys)
    assert code == 2 and "one_run_per_output_dir" in output and "the first run" in output, output
    assert not tripwire


def test_relative_paths_follow_the_spec_file_and_set_follows_the_working_directory(models, tmp_path, monkeypatch,
                                                                                  capsys):
    from toolkit.spec.load import load_spec

    folder = tmp_path / "jobs"
    shutil.copy(PROMPTS, folder.parent / "cwd.jsonl")
    spec = _spec(folder, model={"path": "../models/llama"}, data={"path": "sft.jsonl", **SFT})
    shutil.copytree(models / "llama", tmp_path / "models" / "llama")
    shutil.copy(PROMPTS, folder / "sft.jsonl")
    monkeypatch.chdir(tmp_path / "models")  # anywhere but the spec's folder
    loaded = load_spec(spec)
    assert (loaded.model.path, loaded.data.path) == (str(tmp_path / "models" / "llama"), str(folder / "sft.jsonl"))
    assert loaded.training.output_dir == str(folder / "out")
    assert load_spec(spec, overrides=["data.path=../cwd.jsonl"]).data.path == str(tmp_path / "cwd.jsonl")
    code, output = _dsmt("check", str(spec), capsys=capsys)
    assert code == 0 and f"records in {folder / 'sft.jsonl'}, all readable" in output, output


def test_builtin_shape_name_without_a_folder_is_the_builtin(tmp_path):
    from toolkit.spec.load import load_spec

    spec = load_spec(_spec(tmp_path, model={"path": "tiny-llama"}, data={"synthetic": True}))
    assert (spec.model.builtin, spec.model.path) == ("tiny-llama", None)
    nearby = _spec(tmp_path / "other", model={"path": "./tiny-llama"}, data={"synthetic": True})
    (tmp_path / "other" / "tiny-llama").mkdir()
    assert load_spec(nearby).model.path == str(tmp_path / "other" / "tiny-llama")  # ./ names the folder


def test_model_builtin_is_the_shape_whatever_folders_the_working_directory_holds(tmp_path, monkeypatch, capsys):
    (tmp_path / "tiny-llama").mkdir()
    monkeypatch.chdir(tmp_path)
    spec = _spec(tmp_path / "jobs", model={"builtin": "tiny-llama"}, data={"synthetic": True},
                 training={"train_steps": 20})
    code, output = _dsmt("check", str(spec), capsys=capsys)
    assert code == 0 and "model_path_ambiguous" not in output and "names both" not in output, output


def test_unset_warmup_fits_a_short_run():
    from toolkit.spec.schema import TrainingSpec

    assert TrainingSpec(train_steps=2).warmup_steps == 0
    assert TrainingSpec(train_steps=500).warmup_steps == 50
    assert TrainingSpec().warmup_steps == 100  # 1000 steps: the default
    assert TrainingSpec(train_steps=5, warmup_steps=3).warmup_steps == 3


def test_a_large_file_is_checked_with_a_progress_bar(monkeypatch, capsys):
    from toolkit.data import formats

    records = [{"text": f"record {i}"} for i in range(50)] + [{"body": "no text"}]
    monkeypatch.setattr(formats, "PROGRESS_MIN_RECORDS", 10)
    checked = formats.check_records(records, record_type="text", fields=formats.RecordFields(), source="big.jsonl")
    assert checked.num_records == 51 and str(checked.errors[0]).startswith("record 51")
    assert "checking big.jsonl" in capsys.readouterr().err
    monkeypatch.setattr(formats, "PROGRESS_MIN_RECORDS", 100)
    formats.check_records(records, record_type="text", fields=formats.RecordFields(), source="big.jsonl")
    assert "checking" not in capsys.readouterr().err


@pytest.mark.parametrize("shown", [False, True])
def test_rank_entry_hides_megatron_warnings_unless_asked(shown):
    """`python -m toolkit.train` as the generated scripts start it: megatron warns at import (no Apex / TE)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "DSMT_SHOW_WARNINGS", "DSMT_VERBOSE")}
    if shown:
        env["DSMT_SHOW_WARNINGS"] = "1"
    code = "import toolkit.train.__main__; import megatron.core.optimizer"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, text=True, capture_output=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert ("UserWarning" in result.stderr) == shown, result.stderr[-2000:]
