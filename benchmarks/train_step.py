"""dsmt's training step vs a minimal hand-written megatron-core + DeepSpeed loop, same layout, same run.

    .venv/bin/python -m benchmarks.train_step [--layout tp2-dp2 | pp2-dp2] [--steps 8]   (from the repo root)

Launches 4 gloo ranks on this machine. Both sides use the same megatron GPTModel chunks (built by dsmt's adapters)
and a DeepSpeed engine with the same config; the hand-written side calls megatron's built-in loss (labels passed to
GPTModel) and, at PP > 1, megatron's schedule directly. Steps alternate between the two sides; the script prints the
median step time of each and their ratio (dsmt / hand-written).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

LAYOUTS = {"tp2-dp2": dict(tp=2, pp=1, dp=2), "pp2-dp2": dict(tp=1, pp=2, dp=2)}
MICRO, NUM_MICRO, SEQ = 2, 4, 128


def ds_config(dp: int, *, unmanaged: bool) -> dict:
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": NUM_MICRO,
              "train_batch_size": MICRO * NUM_MICRO * dp, "zero_optimization": {"stage": 1, "overlap_comm": False},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0, "torch_adam": True}}, "steps_per_print": 10**9}
    if unmanaged:
        config["managed_gradient_accumulation"] = False
    return config


def hand_written_step(engine, chunks, batches, *, pp: int) -> None:
    """What a user would write without dsmt."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if pp == 1:
        for b in batches:
            loss = engine(b["tokens"], b["position_ids"], None, labels=b["labels"]).mean()
            engine.backward(loss)
            engine.step()
        return

    def forward_step(iterator, model):
        b = next(iterator)
        return model(b["tokens"], b["position_ids"], None, labels=b["labels"]), lambda out: (out.mean(), {})

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batches), model=chunks[0],
                                num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=MICRO)
    engine.step()


def worker(args) -> None:
    import deepspeed
    import torch.distributed as dist
    from megatron.core import parallel_state

    from toolkit import backend as backends
    from toolkit.data import MicroBatches, synthetic_examples
    from toolkit.convert.chunks import load_model_chunks
    from toolkit.parallel.groups import Layout, init_process_groups
    from toolkit.train.engine.hybrid import HybridEngine
    from toolkit.parallel.mpu import MegatronMpu

    layout = Layout(**LAYOUTS[args.layout])
    backend = backends.current()
    init_process_groups(layout=layout, dist_backend=backend.dist_backend)
    backend.seed(0)
    examples = synthetic_examples(vocab_size=1024, seq_length=SEQ, num_examples=512, seed=0)
    batches = MicroBatches(examples=examples, micro_batch_size=MICRO, num_microbatches=NUM_MICRO,
                           dp_rank=parallel_state.get_data_parallel_rank(), dp_size=layout.dp, seed=0)
    dsmt_chunks, info = load_model_chunks(checkpoint=args.checkpoint, layout=layout)
    dsmt = HybridEngine(chunks=dsmt_chunks, ds_config=ds_config(layout.dp, unmanaged=False),
                        vocab_size=info.settings.vocab_size, tied_embeddings=False, pp_size=layout.pp)
    hand_chunks, _ = load_model_chunks(checkpoint=args.checkpoint, layout=layout)
    hand_engine, *_ = deepspeed.initialize(model=hand_chunks[0], model_parameters=list(hand_chunks[0].parameters()),
                                           config=ds_config(layout.dp, unmanaged=layout.pp > 1), mpu=MegatronMpu())
    times = {"dsmt": [], "hand": []}
    for step in range(args.steps + 2):  # the first two steps of each side are warm-up
        for side in ("dsmt", "hand"):
            dist.barrier()
            start = time.perf_counter()
            if side == "dsmt":
                dsmt.train_step(batches.batches_for_step(step))
            else:
                hand_written_step(hand_engine, [hand_engine.module], batches.batches_for_step(step), pp=layout.pp)
            dist.barrier()
            if step >= 2:
                times[side].append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        d, h = statistics.median(times["dsmt"]), statistics.median(times["hand"])
        print(f"layout {args.layout} (4 ranks, ZeRO-1, {NUM_MICRO} micro-batches of {MICRO} x {SEQ} tokens, "
              f"{args.steps} timed steps each)")
        print(f"median step: dsmt {d * 1000:.1f} ms, hand-written {h * 1000:.1f} ms, ratio dsmt/hand = {d / h:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=list(LAYOUTS), default="tp2-dp2")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--checkpoint", type=Path)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    from toolkit.launch.local import launch_local_workers
    from toolkit.models.tiny import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = make_tiny_checkpoint(Path(scratch) / "hf", hidden_size=256, intermediate_size=512,
                                          num_attention_heads=8, num_key_value_heads=4, vocab_size=1024,
                                          max_position_embeddings=SEQ)
        # run from the repository root: `benchmarks` is then importable as a namespace package by the ranks
        launch_local_workers(module="benchmarks.train_step", nprocs=4, timeout_s=900, log_dir=Path(scratch) / "logs",
                             args=["--worker", "--layout", args.layout, "--steps", str(args.steps), "--checkpoint", str(checkpoint)])


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
