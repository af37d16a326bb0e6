"""The key test: dsmt's hybrid engine trains like an independent one-process HF + torch loop (reference.py).

Every layout runs 6 steps in fp32 with what makes parity hard: warmup + cosine LR (the reference steps transformers'
get_cosine_with_min_lr_schedule_with_warmup itself, and dsmt's logged lr must equal its rates), weight decay on matrices only, gradient
clipping that really triggers (grad_clip 0.5, below every step's norm), and the per-token loss over the global batch.
Per step, dsmt's logged loss, lr and pre-clip grad_norm are compared with the reference's, and at the end its exported
final-hf/model.safetensors with the reference's weights. Tolerances (fp32, CPU, absolute): loss 5e-6, grad norm
1e-5, exported weights 2e-6 (measured: <= 6.0e-7, 9.6e-7, 1.2e-7), lr 1e-12 relative; `pytest -s` prints the
measured figures per layout. A step's lr 0 does not move weights but does fill Adam's moments. Data is packed
(data.packing, the default); at the default lengths every row holds one record (stories are split into pieces of
seq_length + 1, prompt/completion records fill a row of 65), so `sft-packed-...` trains at seq_length 128, where
rows hold several records: the reference runs one HF forward per record.

The cheap tests at the top check the reference itself: its token ids / loss masks equal dsmt's pipeline's for
every rank and micro-batch, the schedule dsmt hands DeepSpeed equals transformers' step by step, and its loss and gradients do not
depend on how the global batch is split into forwards.
"""

import pytest
import torch

from reference import (RunSettings, document_loss_sum, global_batch_loss_backward,
                       global_sample_indices, hf_schedule_lr, load_examples, load_pad_id, rank_rows, row_arrays)
from train_helpers import parity_figures, parity_spec, run_dsmt

# Measured (2 CPU cores, every layout below): loss <= 6.0e-7, grad norm <= 9.6e-7, weights <= 1.2e-7.
LOSS_TOLERANCE = 5e-6
GRAD_NORM_TOLERANCE = 1e-5  # norms are 2-4: 2.5e-6 relative at most
WEIGHT_TOLERANCE = 2e-6

# Lengths at which records share rows: prompt/completion records are 20-88 tokens, stories ~130-190 (split into
# pieces of seq_length + 1 above that). At the default lengths (32; SFT 64) every row holds one record. (The
# tiny models have 128 positions; packed text with short documents: test_train_packing.py.)
PACKED_SFT_SEQ, PACKED_TEXT_SEQ = 128, 256

LAYOUTS = {
    "tp2-pp2-dp2-zero1": dict(tp=2, pp=2, dp=2, zero=1),   # megatron 1F1B schedule + DeepSpeed ZeRO-1, 2 micro-batches
    "tp2-dp2-zero2": dict(tp=2, dp=2, zero=2),             # DeepSpeed loop, gradients partitioned
    "dp2-zero3": dict(dp=2, zero=3, extra={"communication": {"param_persistence_threshold_elements": 0}}),
    "tp2-dp2-zero3": dict(tp=2, dp=2, zero=3, extra={"communication": {"param_persistence_threshold_elements": 0}}),
    # interleaved schedule, 4 micro-batches; ZeRO-1 since DeepSpeed logs no grad norm at ZeRO-0 (None in metrics)
    "pp2-vpp2-zero1": dict(pp=2, vpp=2, dp=1, zero=1, micro=1, global_batch=4),
    "dp2-zero1-ga4": dict(dp=2, zero=1, micro=1),          # gradient accumulation over 4 micro-batches per rank
    "tied-pp2-dp2-zero1": dict(pp=2, dp=2, zero=1, micro=1, tied=True),  # embedding on both stages
    "sft-dp2-micro1": dict(dp=2, zero=1, micro=1, sft=True),       # uneven completion lengths
    "sft-tp2-pp2-dp2-zero1": dict(tp=2, pp=2, dp=2, zero=1, sft=True),
    # packed records (several per row: block-diagonal attention, positions restarting per record)
    "sft-packed-tp2-pp2-dp2-zero1": dict(tp=2, pp=2, dp=2, zero=1, sft=True, seq=PACKED_SFT_SEQ),
    "tp2-dp2-zero1-full-recompute": dict(tp=2, dp=2, zero=1, extra={"training": {"recompute": "full"}}),
    "pp2-dp2-zero1-selective-recompute": dict(pp=2, dp=2, zero=1, extra={"training": {"recompute": "selective"}}),
}


# --- the reference checked on its own (one process, seconds) ----------------------------------------------------

@pytest.mark.parametrize("packing", [True, False], ids=["packed", "unpacked"])
@pytest.mark.parametrize("sft", [False, True], ids=["text", "prompt-completion"])
def test_reference_batches_equal_dsmt_pipeline(sft, packing, tiny_llama, tmp_path):
    """Token ids, loss masks and record boundaries of every (rank, micro-batch) of a step that straddles an epoch
    boundary."""
    from toolkit.data import MicroBatches, build_examples
    from toolkit.spec.load import load_spec

    dp, micro, accum = 2, 2, 3
    spec_path = parity_spec(tmp_path / "job.yaml", model_dir=tiny_llama, output_dir=tmp_path / "out", dp=dp,
                            micro=micro, global_batch=dp * micro * accum, sft=sft, extra={"data": {"packing": packing}},
                            seq=PACKED_SFT_SEQ if sft else PACKED_TEXT_SEQ)
    settings = RunSettings.from_yaml(spec_path)
    records = load_examples(settings)
    token_ids, loss_mask = row_arrays(records, window=settings.seq_length + 1, pad=load_pad_id(settings))
    spec = load_spec(spec_path)
    examples = build_examples(data=spec.data, model_path=str(tiny_llama), seq_length=settings.seq_length,
                              vocab_size=250, seed=settings.seed)
    assert torch.equal(examples.token_ids, token_ids) and torch.equal(examples.loss_mask, loss_mask)
    step = len(token_ids) // settings.global_batch_size  # its positions run past the first epoch's end
    assert (step + 1) * settings.global_batch_size > len(token_ids)
    rows = global_sample_indices(step=step, global_batch_size=settings.global_batch_size, num_examples=len(token_ids),
                                 seed=settings.seed, shuffle=True)
    for rank in range(dp):
        pipeline = MicroBatches(examples=examples, micro_batch_size=micro, num_microbatches=accum, dp_rank=rank,
                                dp_size=dp, seed=settings.seed).batches_for_step(step)
        for m, batch in enumerate(pipeline):
            mine = [rows[j] for j in rank_rows(micro_batch=m, dp_rank=rank, micro_batch_size=micro, dp_size=dp)]
            assert torch.equal(batch["tokens"], token_ids[mine, :-1])
            assert torch.equal(batch["labels"], token_ids[mine, 1:])
            assert torch.equal(batch["loss_mask"], loss_mask[mine])
            # a record starts where dsmt's positions restart; unpacked rows run 0 .. seq_length - 1
            starts = [segment_starts(records[j], seq_length=settings.seq_length) for j in mine] if packing else [
                [0]] * len(mine)
            assert [torch.nonzero(p == 0).flatten().tolist() for p in batch["position_ids"]] == starts
    assert packing == any(len(row) > 1 for row in records)  # packing puts several records in some rows
    if sft and not packing:  # uneven completions: what makes a per-token loss differ from a mean of per-sequence means
        counted = loss_mask.sum(dim=1)
        assert counted.max() >= 2 * counted.min(), counted


@pytest.mark.parametrize("lr_schedule", ["cosine", "linear", "constant"])
@pytest.mark.parametrize("warmup_steps,train_steps", [(0, 6), (1, 6), (2, 6), (3, 10), (2, 2 + 1)])
def test_engine_lr_schedule_equals_transformers(lr_schedule, warmup_steps, train_steps):
    """The schedule dsmt hands deepspeed.initialize, stepped as DeepSpeed's engine steps a client scheduler (read lr,
    update, step), equals transformers' get_*_schedule_with_warmup step by step (the reference's); learning starts
    at step 2 at the latest (DeepSpeed's own WarmupLR / WarmupCosineLR ran steps 1 and 2 at lr 0)."""
    from toolkit.spec.lr_schedule import LrSchedule
    from toolkit.spec.schema import JobSpec

    spec = JobSpec.model_validate({"model": {"builtin": "llama3-8b"}, "training": {
        "lr": 2e-3, "min_lr": 2e-4, "lr_schedule": lr_schedule, "warmup_steps": warmup_steps,
        "train_steps": train_steps}})
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=2e-3)
    scheduler = LrSchedule.from_training(spec.training)(optimizer)
    settings = RunSettings(model_dir=None, data_path=None, text_field="text", prompt_field=None, completion_field=None,
                           shuffle=True, seq_length=1, global_batch_size=1, micro_batch_size=1, lr=2e-3, min_lr=2e-4,
                           lr_schedule=lr_schedule, warmup_steps=warmup_steps, weight_decay=0.0, betas=(0.9, 0.95),
                           eps=1e-8, grad_clip=0.0, train_steps=train_steps, seed=0)
    rates = []
    for step in range(train_steps + 2):
        rates.append(optimizer.param_groups[0]["lr"])
        assert hf_schedule_lr(step=step, settings=settings) == pytest.approx(rates[-1], rel=1e-12, abs=0.0), step
        optimizer.step()
        scheduler.step()
    assert rates[1] > 0 and (rates[0] > 0) == (warmup_steps == 0), rates


def test_the_schedule_state_round_trips_and_reads_deepspeeds_from_older_checkpoints():
    """Its state is JSON (dsmt_layout.json keeps it) and resumes at the same rate; a checkpoint written while dsmt
    used DeepSpeed's WarmupCosineLR ({"last_batch_iteration": i} after i + 1 steps) goes on from step i + 2."""
    import json

    from toolkit.spec.lr_schedule import LrSchedule

    schedule = LrSchedule(kind="cosine", lr=1e-3, min_lr=1e-4, warmup_steps=2, train_steps=10)
    optimizers = [torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3) for _ in range(3)]
    ran, resumed, older = (schedule(optimizer) for optimizer in optimizers)
    for _ in range(5):
        optimizers[0].step()
        ran.step()
    resumed.load_state_dict(json.loads(json.dumps(ran.state_dict())))
    older.load_state_dict({"last_batch_iteration": 4})
    assert ran.last_epoch == resumed.last_epoch == older.last_epoch == 5
    assert optimizers[2].param_groups[0]["lr"] == optimizers[0].param_groups[0]["lr"] > 1e-4
    assert resumed.get_last_lr() == ran.get_last_lr()


def test_reference_loss_and_grads_do_not_depend_on_the_split(tiny_llama, tmp_path):
    """The same SFT global batch as 1 forward of 8 rows or 8 forwards of 1 row: equal loss and gradients; a mean
    of per-micro-batch means (what a per-micro-batch normalisation gives) differs, so the SFT layouts discriminate."""
    from transformers import AutoModelForCausalLM

    spec_path = parity_spec(tmp_path / "job.yaml", model_dir=tiny_llama, output_dir=tmp_path / "out", sft=True)
    settings = RunSettings.from_yaml(spec_path)
    records = load_examples(settings)
    rows = global_sample_indices(step=0, global_batch_size=8, num_examples=len(records), seed=settings.seed,
                                 shuffle=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    results = []
    for chunk_rows in (8, 1):
        model.zero_grad(set_to_none=True)
        loss = global_batch_loss_backward(model, rows=[records[j] for j in rows], chunk_rows=chunk_rows)
        results.append((loss, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss_whole, grads_whole), (loss_split, grads_split) = results
    assert loss_whole == pytest.approx(loss_split, abs=1e-6)
    assert max((grads_whole[n] - grads_split[n]).abs().max().item() for n in grads_whole) < 1e-6
    with torch.no_grad():
        means = []
        for j in rows:
            row_sum = sum(document_loss_sum(model, record) for record in records[j])
            means.append(float(row_sum / sum(sum(flags) for _, flags in records[j])))
    assert abs(sum(means) / len(means) - loss_whole) > 1e-3, (means, loss_whole)


def segment_starts(row, *, seq_length: int) -> list[int]:
    """Input columns where a packed row's records start, and its padding when that begins before the last
    column (padding is a segment of its own)."""
    starts, offset = [], 0
    for ids, _ in row:
        starts.append(offset)
        offset += len(ids)
    return starts + ([offset] if offset < seq_length else [])


# --- dsmt against the reference (one `dsmt train` launch per layout) --------------------------------------------

@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dsmt_matches_independent_reference(name, tiny_llama, tiny_llama_tied, tmp_path):
    options = dict(LAYOUTS[name])
    model_dir = tiny_llama_tied if options.pop("tied", False) else tiny_llama
    spec_path = parity_spec(tmp_path / "job.yaml", model_dir=model_dir, output_dir=tmp_path / "out", **options)
    run_dsmt(spec_path)
    figures = parity_figures(name=name, spec_path=spec_path, output_dir=tmp_path / "out", model_dir=model_dir)
    assert figures["loss"] < LOSS_TOLERANCE
    assert figures["grad_norm"] < GRAD_NORM_TOLERANCE
    assert figures["weight"] < WEIGHT_TOLERANCE
