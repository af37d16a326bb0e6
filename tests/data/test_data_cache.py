"""The on-disk examples cache: tokenised once, reused, invalidated by a changed source, memory-mapped on every
rank, and equal to the uncached examples bit for bit. The 2-rank launch also builds megatron-core's index caches
(toolkit/data/indexed.py), once, on rank 0, while rank 1 waits longer than the collective timeout."""

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from data_helpers import EXAMPLES

from toolkit.cli import main as dsmt
from toolkit.data import MicroBatches, build_examples, cache, open_cache, prepare_cache
from toolkit.errors import DsmtError
from toolkit.launch.ports import free_port
from toolkit.launch.rank0 import lead_task
from toolkit.spec.schema import DataSpec

REPO = Path(__file__).parents[2]


@pytest.fixture
def tokenize_calls(monkeypatch):
    """Counts every tokenisation of a data file (the step the cache must run once)."""
    calls = []
    real = cache.part_examples

    def counting(**kwargs):
        calls.append(kwargs["data"].path)
        return real(**kwargs)

    monkeypatch.setattr(cache, "part_examples", counting)
    return calls


def _prepare(data, tiny_checkpoint, root, cache_dir, vocab_size=250, seq_length=32):
    return prepare_cache(data=data, model_path=str(tiny_checkpoint), seq_length=seq_length, vocab_size=vocab_size,
                         cache_root=root, datasets_cache_dir=cache_dir)


def _assert_same(cached, reference):
    for name in ("token_ids", "loss_mask"):
        a, b = getattr(cached, name), getattr(reference, name)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
    assert (cached.kind, cached.used_chat_template, cached.num_dropped, cached.num_truncated) == (
        reference.kind, reference.used_chat_template, reference.num_dropped, reference.num_truncated)


@pytest.mark.parametrize("fields", [{"path": str(EXAMPLES / "tiny_stories.jsonl")},
                                    {"path": str(EXAMPLES / "tiny_prompts.jsonl"), "prompt_field": "prompt",
                                     "completion_field": "completion"},
                                    {"path": str(EXAMPLES / "tiny_chat.jsonl"), "messages_field": "messages"}],
                         ids=["text", "prompt_completion", "chat"])
def test_written_once_reused_and_equal_to_uncached(fields, tiny_checkpoint, tmp_path, cache_dir, tokenize_calls):
    data = DataSpec(**fields)
    first = _prepare(data, tiny_checkpoint, tmp_path / "cache", cache_dir, seq_length=128)
    again = _prepare(data, tiny_checkpoint, tmp_path / "cache", cache_dir, seq_length=128)
    assert first == again and tokenize_calls == [data.path]  # the second call tokenised nothing
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [first.name]  # no temp dir left behind
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch's "non-writable NumPy array" warning
        cached = open_cache(first)
    reference = build_examples(data=data, model_path=str(tiny_checkpoint), seq_length=128, vocab_size=250, seed=0,
                               cache_dir=cache_dir)
    _assert_same(cached, reference)
    # MicroBatches gathers rows from the memory map exactly as from in-memory tensors.
    layout = dict(micro_batch_size=2, num_microbatches=2, dp_rank=1, dp_size=2, seed=3)
    for step in (0, 7):
        got = MicroBatches(examples=cached, **layout).batches_for_step(step)
        want = MicroBatches(examples=reference, **layout).batches_for_step(step)
        assert all(torch.equal(g[k], w[k]) and g[k].dtype == w[k].dtype for g, w in zip(got, want) for k in w)


def test_changed_source_file_invalidates_the_cache(tiny_checkpoint, tmp_path, cache_dir, write_jsonl, tokenize_calls):
    rows = [{"text": "the cat sat on the mat and then it ran away"}] * 20
    data = DataSpec(path=write_jsonl(rows))
    first = _prepare(data, tiny_checkpoint, tmp_path / "cache", cache_dir)
    write_jsonl(rows + [{"text": "one more story about a dog"}] * 5)
    second = _prepare(data, tiny_checkpoint, tmp_path / "cache", cache_dir)
    assert first != second and len(tokenize_calls) == 2
    assert len(open_cache(second)) > len(open_cache(first))
    _assert_same(open_cache(second), build_examples(data=data, model_path=str(tiny_checkpoint), seq_length=32,
                                                    vocab_size=250, seed=0, cache_dir=cache_dir))


def test_key_follows_what_changes_the_tokens(tiny_checkpoint, tokenizer):
    data = DataSpec(path=str(EXAMPLES / "tiny_stories.jsonl"))
    key = cache.cache_key(data=data, tokenizer=tokenizer, seq_length=32)[0]
    assert cache.cache_key(data=data.model_copy(update={"shuffle": False}), tokenizer=tokenizer, seq_length=32)[0] == key
    assert cache.cache_key(data=data, tokenizer=tokenizer, seq_length=64)[0] != key
    assert cache.cache_key(data=data.model_copy(update={"split": "train[:50%]"}), tokenizer=tokenizer,
                           seq_length=32)[0] != key
    tokenizer.chat_template = "{{ messages }}"
    assert cache.cache_key(data=data, tokenizer=tokenizer, seq_length=32)[0] != key


def test_vocab_check_also_runs_on_a_reused_cache(tiny_checkpoint, tmp_path, cache_dir):
    data = DataSpec(path=str(EXAMPLES / "tiny_stories.jsonl"))
    _prepare(data, tiny_checkpoint, tmp_path / "cache", cache_dir)
    with pytest.raises(DsmtError, match=r"id \d+ but the model's vocab_size is 20"):
        _prepare(data, tiny_checkpoint, tmp_path / "cache", cache_dir, vocab_size=20)


def test_failed_write_leaves_no_entry(tiny_checkpoint, tmp_path, cache_dir, monkeypatch):
    data = DataSpec(path=str(EXAMPLES / "tiny_stories.jsonl"))

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cache.np, "save", disk_full)
    with pytest.raises(OSError, match="No space"):
        _prepare(data, tiny_checkpoint, tmp_path / "cache", cache_dir)
    assert list((tmp_path / "cache").iterdir()) == []


def test_no_path_without_synthetic_is_refused_by_name(tiny_checkpoint):
    with pytest.raises(DsmtError, match="data_source.*data.synthetic: true"):
        build_examples(data=DataSpec(), model_path=str(tiny_checkpoint), seq_length=8, vocab_size=250, seed=0)
    synthetic = build_examples(data=DataSpec(synthetic=True), model_path=None, seq_length=8, vocab_size=250, seed=0)
    assert synthetic.kind == "synthetic"


def test_simulated_nonzero_rank_only_opens_what_rank_zero_wrote(tiny_checkpoint, tmp_path, cache_dir, monkeypatch,
                                                                 tokenize_calls):
    import torch.distributed as dist

    data = DataSpec(path=str(EXAMPLES / "tiny_stories.jsonl"))
    written = _prepare(data, tiny_checkpoint, tmp_path / "cache", cache_dir)  # what rank 0 did
    tokenize_calls.clear()
    monkeypatch.setattr(cache, "load_tokenizer", lambda **kwargs: pytest.fail("rank 1 loaded a tokenizer"))
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    status_file = tmp_path / "status.json"

    def rank_zero_token(objects, src=0, group=None, device=None):
        assert objects == [None]  # this rank contributes nothing
        objects[0] = "job-1"

    monkeypatch.setattr(dist, "broadcast_object_list", rank_zero_token)
    lead_task(lambda progress: str(written), status_file=status_file, token="job-1")  # what rank 0 published
    examples = cache.shared_examples(data=data, model_path=str(tiny_checkpoint), seq_length=32, vocab_size=250,
                                     seed=0, cache_root=tmp_path / "cache", status_file=status_file)
    assert tokenize_calls == [] and len(examples) > 0
    _assert_same(examples, open_cache(written))

    def rank_zero_fails(progress):
        raise DsmtError("data.path='x.jsonl' does not exist")

    with pytest.raises(DsmtError):
        lead_task(rank_zero_fails, status_file=status_file, token="job-1")
    with pytest.raises(DsmtError, match="preparing the training data failed on rank 0: DsmtError: data.path='x.jsonl'"):
        cache.shared_examples(data=data, model_path=str(tiny_checkpoint), seq_length=32, vocab_size=250, seed=0,
                              cache_root=tmp_path / "cache", status_file=status_file)


# Megatron corpora in the same launch (toolkit/data/indexed.py): rank 0's index build is made to last SLOW_S, longer
# than the group's collective timeout TIMEOUT_S, set just before it (after the data cache: a slow start under load
# must not trip it); rank 1 must wait on rank 0's status file, not in a collective, and read the caches it wrote.
TIMEOUT_S, SLOW_S = 5, 8
WORKER = textwrap.dedent('''
    import json, sys, time
    from datetime import timedelta
    from pathlib import Path
    import torch
    import torch.distributed as dist
    from megatron.core.datasets import gpt_dataset
    from toolkit.data import cache
    from toolkit.data.indexed import megatron_rows
    from toolkit.spec.schema import DataSpec

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    calls = []
    real = cache.part_examples
    cache.part_examples = lambda **kw: calls.append(1) or real(**kw)
    model_dir, root, out, path, corpus_a, corpus_b, timeout_s, slow_s = sys.argv[1:9]
    data = DataSpec(path=path)
    examples = cache.shared_examples(data=data, model_path=model_dir, seq_length=32, vocab_size=250, seed=0,
                                     cache_root=root, status_file=f"{out}/data.status.json")

    index_builds = []
    real_index = gpt_dataset._build_document_index  # called only when an index cache is missing

    def slow_index(*args, **kwargs):
        if rank == 0 and not index_builds:
            time.sleep(float(slow_s))
        index_builds.append(1)
        return real_index(*args, **kwargs)

    gpt_dataset._build_document_index = slow_index
    dist.barrier()
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=float(timeout_s)))
    started = time.monotonic()
    rows = megatron_rows(data=DataSpec(blend=[[1, corpus_a], [3, corpus_b]]), model_path=model_dir, part="train",
                         num_samples=40, seq_length=16, vocab_size=250, seed=0, cache_root=Path(out) / "megatron")
    megatron = {"index_builds": len(index_builds), "seconds": time.monotonic() - started,
                "ids": rows.rows(torch.arange(len(rows)))[0].tolist()}
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"tokenised": len(calls), "ids": examples.token_ids.tolist(), "mask": examples.loss_mask.tolist(),
                   "megatron": megatron}, f)
    dist.destroy_process_group()
''')


@pytest.mark.multiproc
def test_two_gloo_ranks_tokenise_and_index_once_on_rank_zero(tiny_checkpoint, tmp_path, cache_dir):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    path = str(EXAMPLES / "tiny_stories.jsonl")
    corpora = [str(tmp_path / f"corpus_{name}") for name in "ab"]
    for corpus in corpora:
        assert dsmt(["data", "prepare", path, "--tokenizer", str(tiny_checkpoint), "--output", corpus,
                     "--workers", "1"]) == 0
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
               f"--master_port={free_port()}", str(script), str(tiny_checkpoint), str(tmp_path / "cache"),
               str(tmp_path), path, *corpora, str(TIMEOUT_S), str(SLOW_S)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "HF_DATASETS_CACHE": cache_dir}
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["tokenised"] for r in ranks] == [1, 0]
    reference = build_examples(data=DataSpec(path=path), model_path=str(tiny_checkpoint), seq_length=32,
                               vocab_size=250, seed=0, cache_dir=cache_dir)
    for r in ranks:
        assert r["ids"] == reference.token_ids.tolist() and r["mask"] == reference.loss_mask.tolist()
    megatron = [r["megatron"] for r in ranks]
    assert megatron[0]["index_builds"] > 0 and megatron[1]["index_builds"] == 0  # rank 1 read rank 0's caches
    assert megatron[1]["seconds"] > TIMEOUT_S  # it waited longer than a collective may, on the status file
    assert megatron[0]["ids"] == megatron[1]["ids"] and len(megatron[0]["ids"]) >= 40
    assert not list((tmp_path / "megatron").glob(".dsmt-index-build-*"))  # the status file is removed once read
