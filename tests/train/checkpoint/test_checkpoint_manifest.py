"""toolkit/train/checkpoint/manifest.py and `dsmt checkpoint verify` on hand-made tags (no process group, no torch
files): a round trip is intact, each kind of damage is named with its file, the per-rank shares cover every file
once with balanced bytes, and every path form and tag state is reported."""

import argparse
import json
import random

import pytest

from toolkit.data import files
from toolkit.errors import DsmtError
from toolkit.train.checkpoint import cli, manifest

FILES = {
    "mp_rank_00_model_states.pt": b"m" * 300,
    "zero_pp_rank_0_mp_rank_00_optim_states.pt": bytes(range(256)) * 2,
    "dsmt_rng_rank0.pt": b"rng",
    "layout-free/__0_0.distcp": b"\x01\x02" * 100,
    "layout-free/.metadata": b"meta",
}


def make_tag(checkpoint_dir, step, *, with_manifest=True, complete=True):
    tag_dir = checkpoint_dir / f"step_{step:06d}"
    for name, data in FILES.items():
        (tag_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (tag_dir / name).write_bytes(data)
    if with_manifest:
        manifest.write_manifest(tag_dir, manifest.entries_for(tag_dir, manifest.list_files(tag_dir)))
    if complete:
        record = {"step": step, "world_size": 1, "layout": None, "manifest": with_manifest}
        (tag_dir / manifest.COMPLETE_MARKER).write_text(manifest.marker_text(tag_dir, record))
    return tag_dir


def test_listing_skips_manifest_and_marker_and_is_sorted_posix(tmp_path):
    tag_dir = make_tag(tmp_path, 1)
    assert manifest.list_files(tag_dir) == sorted(FILES)
    record = manifest.read_manifest(tag_dir)
    assert record["format"] == 1 and record["digest"] == "xxh3_128"
    assert record["total_bytes"] == sum(len(data) for data in FILES.values())
    assert list(record["files"]) == sorted(FILES)
    assert record["files"]["dsmt_rng_rank0.pt"]["size"] == 3
    assert not list(tag_dir.glob(f".{manifest.MANIFEST}*")), "the temp file was replaced"


def test_complete_marker_name_is_the_one_checkpoints_writes():
    from toolkit.train.checkpoint import checkpoints

    assert manifest.COMPLETE_MARKER == checkpoints.COMPLETE_MARKER


def test_digest_streams_across_chunks(tmp_path, monkeypatch):
    import xxhash

    data = bytes(random.Random(0).randrange(256) for _ in range(10_000))
    (tmp_path / "f").write_bytes(data)
    monkeypatch.setattr(files, "CHUNK_BYTES", 777)  # many chunks, the last one short
    assert manifest.digest_file(tmp_path / "f") == xxhash.xxh3_128(data).hexdigest()


def test_round_trip_is_intact(tmp_path):
    verdict = manifest.verify_tag(make_tag(tmp_path, 8))
    assert (verdict.status, verdict.problems, verdict.files) == ("intact", [], len(FILES))
    assert verdict.total_bytes == sum(len(data) for data in FILES.values())


def test_one_flipped_byte_is_a_digest_problem_naming_the_file(tmp_path):
    tag_dir = make_tag(tmp_path, 8)
    path = tag_dir / "layout-free/__0_0.distcp"
    data = bytearray(path.read_bytes())
    data[57] ^= 0x10
    path.write_bytes(bytes(data))
    verdict = manifest.verify_tag(tag_dir)
    assert verdict.status == "damaged"
    [problem] = verdict.problems
    assert (problem.file, problem.kind) == ("layout-free/__0_0.distcp", "digest")
    assert problem.line().startswith("layout-free/__0_0.distcp: digest ")
    assert f"{problem.expected[:8]}..(manifest) != {problem.found[:8]}..(on disk)" in problem.line()


def test_a_truncated_file_is_a_size_problem_and_is_not_hashed(tmp_path, monkeypatch):
    tag_dir = make_tag(tmp_path, 8)
    (tag_dir / "mp_rank_00_model_states.pt").write_bytes(b"m" * 120)
    hashed, digest_file = [], manifest.digest_file
    monkeypatch.setattr(manifest, "digest_file", lambda path: hashed.append(path.name) or digest_file(path))
    [problem] = manifest.check_entries(tag_dir, manifest.read_manifest(tag_dir)["files"])
    assert "mp_rank_00_model_states.pt" not in hashed and len(hashed) == len(FILES) - 1
    assert (problem.kind, problem.expected, problem.found) == ("size", 300, 120)
    assert problem.line() == ("mp_rank_00_model_states.pt: 120 bytes on disk, 300 in the manifest "
                              "(truncated or overwritten)")


def test_a_deleted_file_is_missing_and_an_extra_one_unlisted(tmp_path):
    tag_dir = make_tag(tmp_path, 8)
    (tag_dir / "dsmt_rng_rank0.pt").unlink()
    (tag_dir / "layout-free/__1_0.distcp").write_bytes(b"stray")
    verdict = manifest.verify_tag(tag_dir)
    assert verdict.status == "damaged"
    assert [(p.file, p.kind) for p in verdict.problems] == [("dsmt_rng_rank0.pt", "missing"),
                                                            ("layout-free/__1_0.distcp", "unlisted")]
    assert verdict.problems[1].found == 5 and "not in the manifest" in verdict.problems[1].line()


def test_an_unreadable_manifest_is_a_named_error_and_a_damaged_tag(tmp_path):
    tag_dir = make_tag(tmp_path, 8)
    (tag_dir / manifest.MANIFEST).write_text('{"format": 1, "files": {')
    with pytest.raises(DsmtError, match=str(tag_dir / manifest.MANIFEST)):
        manifest.read_manifest(tag_dir)
    verdict = manifest.verify_tag(tag_dir)
    assert verdict.status == "damaged" and verdict.problems[0].kind == "unreadable"
    assert manifest.tag_bytes(tag_dir) == sum(len(data) for data in FILES.values())  # falls back to the sizes


def test_the_marker_is_checked_and_ties_the_manifest_to_it(tmp_path):
    tag_dir, marker = make_tag(tmp_path, 8), tmp_path / "step_000008" / manifest.COMPLETE_MARKER

    def said():
        return [problem.line() for problem in manifest.verify_tag(tag_dir).problems]

    assert manifest.verify_tag(tag_dir).status == "intact"
    marker.write_bytes((make_tag(tmp_path, 4) / manifest.COMPLETE_MARKER).read_bytes())  # another tag's
    assert said() == ["dsmt_complete.json: records step 4, not this tag's (a marker of another checkpoint)"]
    for text, line in (('{"step": 8}', "missing or malformed: world_size (int)"),
                       ("[8]", "a JSON list, not the save's record"),
                       ('{"step": 8, "world_', "not readable JSON (JSONDecodeError: ")):
        marker.write_text(text)
        assert said()[0].startswith(f"dsmt_complete.json: {line}")
    with pytest.raises(DsmtError, match=r"^\[checkpoint_damaged\] .*dsmt_complete.json: not readable JSON"):
        manifest.read_marker(tag_dir)
    marker.write_text(json.dumps({"step": 8, "world_size": 1, "manifest": True}))  # an older dsmt's: no digests
    assert manifest.verify_tag(tag_dir).status == "intact"
    make_tag(tmp_path, 8)
    (tag_dir / "dsmt_rng_rank0.pt").write_bytes(b"RNG")  # and a manifest that matches it, written after the marker
    manifest.write_manifest(tag_dir, manifest.entries_for(tag_dir, manifest.list_files(tag_dir)))
    assert said() == ["dsmt_manifest.json: not the manifest dsmt_complete.json recorded (its digest differs: "
                      "changed after the save)"]


def test_share_covers_every_file_once_and_balances_bytes():
    files, sizes = ["a", "b", "c", "d", "e"], [100, 60, 50, 40, 10]
    shares = [manifest.share(files, sizes, rank=r, world_size=2) for r in range(2)]
    by_name = dict(zip(files, sizes, strict=True))
    # 130/130 is impossible here (no subset sums to 130); largest-first greedy finds the best split, 140/120
    assert shares == [["a", "d"], ["b", "c", "e"]]
    assert [sum(by_name[f] for f in s) for s in shares] == [140, 120]
    assert manifest.share(files[::-1], sizes[::-1], rank=0, world_size=2) == shares[0]  # order-free: same on all ranks


@pytest.mark.parametrize("world_size", [1, 3, 8, 20])
def test_share_partitions_random_sizes_within_one_file_of_balance(world_size):
    rng = random.Random(world_size)
    files = [f"f{i:03d}" for i in range(37)]
    sizes = [rng.randrange(1, 10_000) for _ in files]
    shares = [manifest.share(files, sizes, rank=r, world_size=world_size) for r in range(world_size)]
    assert sorted(f for s in shares for f in s) == files
    loads = [sum(sizes[files.index(f)] for f in s) for s in shares]
    assert max(loads) - min(loads) <= max(sizes)  # the bound of greedy list scheduling


def test_share_rejects_bad_arguments():
    with pytest.raises(DsmtError, match="rank=2, world_size=2"):
        manifest.share(["a"], [1], rank=2, world_size=2)
    with pytest.raises(DsmtError, match="1 files but 2 sizes"):
        manifest.share(["a"], [1, 2], rank=0, world_size=1)


def test_verify_run_from_output_dir_checkpoints_dir_and_tag_dir(tmp_path):
    checkpoint_dir = tmp_path / "out" / "checkpoints"
    for step in (12, 4, 100):
        make_tag(checkpoint_dir, step)
    (checkpoint_dir / "step_9").mkdir()  # unpadded: last by name, third by step number
    (checkpoint_dir / "latest_complete").write_text("step_000100")  # a file, not a tag
    for path in (tmp_path / "out", checkpoint_dir):
        verdicts = manifest.verify_run(path)
        assert [v.tag for v in verdicts] == ["step_000004", "step_9", "step_000012", "step_000100"]
    assert [v.status for v in verdicts] == ["intact", "incomplete", "intact", "intact"]
    [one] = manifest.verify_run(checkpoint_dir / "step_000012")
    assert (one.tag, one.status) == ("step_000012", "intact")


def test_no_manifest_incomplete_and_partial_dirs(tmp_path):
    checkpoint_dir = tmp_path / "checkpoints"
    make_tag(checkpoint_dir, 4, with_manifest=False)
    make_tag(checkpoint_dir, 8)
    make_tag(checkpoint_dir, 12, complete=False)
    partial = checkpoint_dir / ".partial-step_000016"
    partial.mkdir()
    (partial / "mp_rank_00_model_states.pt").write_bytes(b"x" * 10)
    (partial / manifest.COMPLETE_MARKER).write_text("{}")  # even marked: a .partial- dir never became a tag
    verdicts = manifest.verify_run(checkpoint_dir)
    assert [(v.tag, v.status) for v in verdicts] == [
        ("step_000004", "no_manifest"), ("step_000008", "intact"), ("step_000012", "incomplete"),
        (".partial-step_000016", "incomplete")]
    assert verdicts[-1].total_bytes == 10
    assert manifest.tag_bytes(checkpoint_dir / "step_000004") == sum(len(data) for data in FILES.values())


def test_tag_bytes_reads_the_manifest_total(tmp_path):
    tag_dir = make_tag(tmp_path, 8)
    (tag_dir / "dsmt_rng_rank0.pt").unlink()  # the manifest's figure, not a new listing
    assert manifest.tag_bytes(tag_dir) == sum(len(data) for data in FILES.values())


def test_verify_run_names_a_path_that_holds_no_checkpoints(tmp_path):
    (tmp_path / "logs").mkdir()
    with pytest.raises(DsmtError, match=rf"{tmp_path} holds no checkpoints: expected a run's output directory"):
        manifest.verify_run(tmp_path)
    with pytest.raises(DsmtError, match="is not a directory"):
        manifest.verify_run(tmp_path / "nowhere")


def parse(argv):
    parser = argparse.ArgumentParser(prog="dsmt")
    cli.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_cli_exit_codes_and_lines(tmp_path, capsys):
    checkpoint_dir = tmp_path / "checkpoints"
    make_tag(checkpoint_dir, 4, with_manifest=False)
    make_tag(checkpoint_dir, 8)
    (checkpoint_dir / ".partial-step_000016").mkdir()
    args = parse(["checkpoint", "verify", str(tmp_path)])
    assert args.func(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("step_000004           no manifest (written before dsmt checksummed")
    assert out[1].startswith("step_000008           intact   0.0 MB  (5 files, ")
    assert out[2] == ".partial-step_000016  incomplete (an interrupted save; removed at the next save or resume)"
    assert out[3] == "newest intact: step_000008, the tag a resume would take"

    make_tag(checkpoint_dir, 12)
    (checkpoint_dir / "step_000012" / "layout-free/__0_0.distcp").write_bytes(b"\x01\x02" * 99 + b"\x01\x03")
    assert args.func(args) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[2].startswith("step_000012           DAMAGED  layout-free/__0_0.distcp: digest ")
    assert out[-1].startswith("newest intact: step_000008, the tag a resume would take; damaged: step_000012")


def test_cli_json_lists_every_verdict(tmp_path, capsys):
    tag_dir = make_tag(tmp_path / "checkpoints", 8)
    (tag_dir / "dsmt_rng_rank0.pt").write_bytes(b"RNG")
    args = parse(["checkpoint", "verify", str(tag_dir), "--json"])
    assert args.func(args) == 1
    [verdict] = json.loads(capsys.readouterr().out)
    assert verdict["tag"] == "step_000008" and verdict["status"] == "damaged"
    assert verdict["problems"][0]["file"] == "dsmt_rng_rank0.pt" and verdict["problems"][0]["kind"] == "digest"


def test_cli_bad_path_is_a_dsmt_error(tmp_path):
    args = parse(["checkpoint", "verify", str(tmp_path / "missing")])
    with pytest.raises(DsmtError, match="missing is not a directory"):
        args.func(args)
    assert DsmtError.exit_code == 2  # what `dsmt` returns for it


def test_cli_module_is_cheap_to_import():
    import subprocess
    import sys

    probe = ("import sys, toolkit.train.checkpoint.cli, toolkit.train.checkpoint.manifest; "
             "print(sorted(m for m in ('torch', 'deepspeed', 'megatron') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
