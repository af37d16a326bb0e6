"""Your own training loop on dsmt: megatron-core TP / PP models from an HF checkpoint inside DeepSpeed ZeRO, with
your data pipeline, your evaluation and your logging. Start it as any DeepSpeed or torchrun script:

    torchrun --nproc_per_node 2 examples/own_loop.py --spec examples/own_loop.yaml
    deepspeed --hostfile hostfile examples/own_loop.py --spec examples/own_loop.yaml   # hostfile: `node1 slots=8`
    srun python examples/own_loop.py --spec my_job.yaml

The job spec (examples/own_loop.yaml: a tiny random Llama, 2 CPU ranks, ZeRO-2) says the model, the layout and the
optimizer; it needs no `data` section. This script reads a jsonl file of {"text": ...} records, tokenises them
with the model's tokenizer (one record per row, right-padded, labels -100 on the padding), holds out a tenth for
evaluation, trains, evaluates before and after, saves a resumable checkpoint and exports an HF checkpoint that
`transformers` loads.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from toolkit import api

HERE = Path(__file__).resolve().parent


def tokenise(path: Path, *, tokenizer, seq_length: int) -> dict[str, torch.Tensor]:
    """Every record as one row of seq_length tokens (EOS appended, cut at seq_length), right-padded."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            ids = tokenizer(json.loads(line)["text"])["input_ids"] + [tokenizer.eos_token_id]
            rows.append(ids[:seq_length])
    input_ids = torch.full((len(rows), seq_length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), seq_length), dtype=torch.long)
    for index, ids in enumerate(rows):
        input_ids[index, :len(ids)] = torch.tensor(ids)
        attention_mask[index, :len(ids)] = 1
    labels = input_ids.masked_fill(attention_mask == 0, -100)  # HF's convention: shifted inside the model
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def micro_batches(rows: dict[str, torch.Tensor], *, run, step: int):
    """This data-parallel rank's micro-batches of one global batch: the step's global_batch_size rows (cycling
    through the data), this rank's contiguous share of them, in micro_batch_size pieces."""
    layout = run.layout
    total = len(rows["input_ids"])
    chosen = (torch.arange(layout.global_batch_size) + step * layout.global_batch_size) % total
    share = chosen.view(run.dp_size, -1)[run.dp_rank]
    for piece in share.split(layout.micro_batch_size):
        yield {key: value[piece] for key, value in rows.items()}


def eval_batches(rows: dict[str, torch.Tensor], *, run):
    """Every held-out row once: rank r takes rows r, r + dp, ...; the last micro-batch may be short, so it is
    padded with rows that count nothing (labels -100)."""
    mine = torch.arange(run.dp_rank, len(rows["input_ids"]), run.dp_size)
    micro = run.layout.micro_batch_size
    for piece in mine.split(micro):
        batch = {key: value[piece] for key, value in rows.items()}
        short = micro - len(piece)
        if short:
            batch = {key: torch.cat([value, value[:1].expand(short, -1)]) for key, value in batch.items()}
            batch["labels"][-short:] = -100
            batch["attention_mask"][-short:] = 1  # all tokens, no loss: a row that counts nothing
        yield batch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", type=Path, default=HERE / "own_loop.yaml", help="job spec (YAML / JSON)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a spec value")
    parser.add_argument("--data", type=Path, default=HERE / "data" / "tiny_stories.jsonl")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=None,
                        help="checkpoints/ and hf/ go here (default: the spec's training.output_dir, where "
                             "init-hf/ and monitor/ go too)")
    parser.add_argument("--resume", action="store_true", help="continue from OUT/checkpoints")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed
    args = parser.parse_args(argv)

    run = api.initialize(args.spec, overrides=args.set)  # every process; raises the same error on every rank
    args.out = args.out or Path(run.spec.training.output_dir)  # resolved: against the spec file's folder
    say = print if run.rank == 0 else (lambda *_, **__: None)
    say(f"layout {run.layout.parallel_label()}, {run.micro_batches_per_step} micro-batches per step and rank, "
        f"global batch {run.layout.global_batch_size} x {run.layout.seq_length} tokens")

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(run.model_dir)
    rows = tokenise(args.data, tokenizer=tokenizer, seq_length=run.layout.seq_length)
    held_out = len(rows["input_ids"]) // 10
    train_rows = {key: value[held_out:] for key, value in rows.items()}
    eval_rows = {key: value[:held_out] for key, value in rows.items()}

    start = run.load_checkpoint(args.out / "checkpoints") if args.resume else 0
    before = run.eval_step(eval_batches(eval_rows, run=run))
    say(f"eval loss {before['loss']:.4f} over {before['tokens']} tokens at step {start}")
    for step in range(start, args.steps):
        stats = run.train_step(micro_batches(train_rows, run=run, step=step))
        say(f"step {step + 1} loss {stats['loss']:.6f} grad_norm {stats['grad_norm']:.4f} lr {stats['lr']:.2e} "
            f"tokens {stats['tokens']}")
    after = run.eval_step(eval_batches(eval_rows, run=run))
    say(f"eval loss {after['loss']:.4f} over {after['tokens']} tokens at step {args.steps}")

    saved = run.save_checkpoint(args.out / "checkpoints")
    hf_dir = run.export_hf(args.out / "hf", overwrite=True)
    say(f"checkpoint {saved}; HF export {hf_dir}")
    if run.rank == 0:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(hf_dir)
        print(f"{hf_dir} loads as {type(model).__name__} ({sum(p.numel() for p in model.parameters())} parameters)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
