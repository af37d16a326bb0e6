"""A checkpoint's cost per rank (toolkit/train/checkpoint/sharded.py, writer.py): each rank writes its own ZeRO share
of the fp32 master weights and Adam moments, so a save and a resume hold at most about that share in host memory
on any rank, and every rank writes about the same bytes. Before, DP rank 0 gathered and wrote its whole TP x PP
shard (12 bytes per parameter) and a resume asked every rank for full-shape fp32 templates.

One 4-rank launch (DP 4, ZeRO-1, fp32, a 25M-parameter Llama: a ~75 MB share per rank, far above RSS noise),
measured by save_memory_probe.py:
    background   3 steps, checkpoints at 2 (in the background: its writer is slowed 3 s) and 3 (the last)
    foreground   the same with training.async_save: false
    resumed      `background` cut back to step 2, resumed to step 3
"""

import json
from pathlib import Path

import pytest

from train_helpers import read_metrics, write_spec

pytestmark = pytest.mark.multiproc
SLACK = 64 * 2**20  # the bound: 1.5 x the rank's share + 64 MiB
WRITE_DELAY_S = 3.0


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    from ranks import run_on_ranks

    from toolkit.models.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("save-memory")
    model = make_tiny_checkpoint(root / "model", hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                                 seed=3)

    def spec(name: str, **training) -> str:
        return str(write_spec(root / f"{name}.yaml", model_dir=model, output_dir=root / name, dp=4, zero=1,
                              global_batch=4, micro=1, steps=3, checkpoint_interval=2, seq=16,
                              extra={"training": {"keep_checkpoints": None, **training}}))

    plan = [("train", spec("background", async_save=True)), ("train", spec("foreground", async_save=False)),
            ("cut", str(root / "background"), str(root / "resumed"), 2), ("train", spec("resumed"))]
    (root / "plan.json").write_text(json.dumps(plan))
    probe = root / "probe"
    probe.mkdir()
    run_on_ranks("tests/train/save_memory_probe.py", root / "plan.json", nprocs=4, timeout=900,
                 # glibc's dynamic mmap threshold keeps freed large buffers in the heap, so the high-water mark
                 # would add up transients; a fixed threshold returns each to the OS when it is freed
                 env={"DSMT_SAVE_PROBE": str(probe), "MALLOC_MMAP_THRESHOLD_": str(1 << 20),
                      "DSMT_PROBE_WRITE_DELAY_S": str(WRITE_DELAY_S)})
    ranks = [[json.loads(line) for line in (probe / f"rank{r}.jsonl").read_text().splitlines()] for r in range(4)]
    return root, ranks


def _share_bytes(root: Path, rank: int) -> int:
    return (root / "background" / "checkpoints" / "step_000002" / "state" / f"rank_{rank:05d}.safetensors").stat(
        ).st_size


def test_every_rank_writes_its_share_and_holds_no_more(measured):
    root, ranks = measured
    shares = [_share_bytes(root, rank) for rank in range(4)]
    assert min(shares) > 50 * 2**20 and max(shares) < 1.1 * min(shares)  # about 1/4 of 12 bytes x 25M each
    for rank, records in enumerate(ranks):
        bound = 1.5 * shares[rank] + SLACK
        # A save's peak above the training's memory; a resume's above the state the run then trains with (the
        # Adam moments a resume creates are held by every run after its first step: what stays resident after
        # the call is that state, measured)
        costs = [(r["kind"], r["step"], r["peak_above_baseline"] - (r["kept_after"] if r["kind"] == "resume" else 0))
                 for r in records if r["kind"] in ("save", "resume")]
        print(f"\nrank {rank}: share {shares[rank] / 2**20:.0f} MiB, bound {bound / 2**20:.0f} MiB; "
              + ", ".join(f"{kind} {step}: {peak / 2**20:.0f} MiB" for kind, step, peak in costs))
        assert len(costs) == 2 + 2 + 2 + 1 + 1  # (resume + 2 saves) x 2 runs, then resume + 1 save
        assert all(peak <= bound for _, _, peak in costs), costs


def test_the_background_save_returns_before_its_write_ends_and_changes_no_loss(measured):
    root, ranks = measured
    for records in ranks:
        saves = [r for r in records if r["kind"] == "save"]
        written = [r for r in records if r["kind"] == "written"]
        background = saves[0]  # run `background`, step 2
        assert background["background"] and written[0]["tag"] == ".partial-step_000002"
        assert background["returned"] < written[0]["ended"] - WRITE_DELAY_S / 2  # training went on meanwhile
        foreground = saves[2]  # run `foreground`, step 2: returns once written
        assert not foreground["background"] and foreground["returned"] > written[2]["ended"]
    runs = {name: read_metrics(root / name) for name in ("background", "foreground", "resumed")}
    assert [m["loss"] for m in runs["background"]] == [m["loss"] for m in runs["foreground"]]
    assert [m["loss"] for m in runs["resumed"]] == [m["loss"] for m in runs["background"]]  # bit-exact resume
    manifests = [json.loads((root / name / "checkpoints" / "step_000002" / "dsmt_manifest.json").read_text())
                 for name in ("background", "foreground")]
    state = [{k: v for k, v in m["files"].items() if k.startswith("state/")} for m in manifests]
    assert state[0] == state[1] and len(state[0]) == 5  # the same bytes, hashed while written
