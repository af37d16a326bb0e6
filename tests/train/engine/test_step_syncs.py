"""No read back from the device inside a training step: the GPU would wait for the host there.

On a GPU every `.item()`, `.tolist()`, `.cpu()`, `int(t)` or Python `if t` of a device tensor waits for every kernel
queued before it; inside megatron's 1F1B schedule that stalls the pipeline. This machine has no GPU, so the batches
the engine copies "to the device" are made `DeviceTensor`s: a tensor subclass that records each read back, and
whose type every tensor computed from it inherits (activations, logits, losses, the p2p activations of the next
stage). A step must read nothing back before `_step_stats`, its one read of the loss and counts at the end.

This file is also the 2-rank probe: `torchrun ... test_step_syncs.py MODEL_DIR OUT_DIR` trains one step at PP = 2
(megatron's 1F1B) and one at DP = 2 (DeepSpeed's loop), each with plain and with packed micro-batches."""

import json
import sys
import traceback
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.multiproc
READS = frozenset({"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero",
                   "equal", "unique", "masked_select"})


class DeviceTensor(torch.Tensor):
    """A CPU tensor standing for a GPU one: `reads` collects (call, where) for every read back to the host."""

    reads: list[tuple[str, str]] = []
    allowed = False  # True inside the step's end-of-step read (`_step_stats`)
    read_at_end = 0  # the reads there: proof that the step's loss was computed from DeviceTensors

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS and cls.allowed:
            cls.read_at_end += 1
        elif name in READS:
            frames = [f for f in traceback.extract_stack()[:-1] if "/tests/" not in f.filename]
            where = next((f"{f.filename.split('site-packages/')[-1]}:{f.lineno}" for f in reversed(frames)), "?")
            cls.reads.append((name, where))
        return super().__torch_function__(func, types, args, kwargs or {})


def to_fake_device(batches: list[dict]) -> list[dict]:
    return [{key: value.as_subclass(DeviceTensor) if isinstance(value, torch.Tensor) else value
             for key, value in batch.items()} for batch in batches]


def micro_batches(*, packed: bool, count: int, vocab: int, seq: int = 32) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    positions = torch.arange(seq)
    if packed:  # three records per row
        positions = torch.cat([torch.arange(10), torch.arange(12), torch.arange(seq - 22)])
    batches = []
    for _ in range(count):
        tokens = torch.randint(0, vocab, (2, seq + 1), generator=generator)
        batches.append({"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                        "loss_mask": torch.ones(2, seq), "position_ids": positions.expand(2, seq).contiguous()})
    return batches


def train_one_step(*, model_dir: str, pp: int, dp: int, out: dict) -> None:
    from megatron.core import parallel_state

    from toolkit import backend as backends
    from toolkit.backend import copies
    from toolkit.convert.chunks import load_model_chunks
    from toolkit.generate.deepspeed_config import build_deepspeed_config
    from toolkit.parallel.groups import Layout
    from toolkit.spec.layout import derive_layout
    from toolkit.spec.load import load_spec
    from toolkit.train.engine.hybrid import HybridEngine
    from train_helpers import write_spec

    spec_path = write_spec(Path(out["dir"]) / f"pp{pp}.yaml", model_dir=Path(model_dir), output_dir=Path(out["dir"]),
                           pp=pp, dp=dp, micro=2, global_batch=2 * dp * 2, seq=32)
    spec = load_spec(spec_path)
    layout = derive_layout(spec)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp)
    backends.current().seed(0)
    chunks, info = load_model_chunks(checkpoint=Path(model_dir), layout=Layout(tp=1, pp=pp, dp=dp),
                                     params_dtype=torch.float32)
    hybrid = HybridEngine(chunks=chunks, ds_config=build_deepspeed_config(spec=spec, layout=layout),
                          vocab_size=info.settings.vocab_size, tied_embeddings=info.settings.tied_embeddings,
                          pp_size=pp)
    step_stats = hybrid._step_stats

    def readout(*args, **kwargs):
        DeviceTensor.allowed = True
        try:
            return step_stats(*args, **kwargs)
        finally:
            DeviceTensor.allowed = False

    hybrid._step_stats = readout
    copies.copy_on_host = to_fake_device  # what Backend.to_device calls on the CPU
    for packed in (False, True):
        DeviceTensor.reads, DeviceTensor.read_at_end = [], 0
        stats = hybrid.train_step(micro_batches(packed=packed, count=2, vocab=info.settings.vocab_size))
        out[f"pp{pp}-dp{dp}-{'packed' if packed else 'plain'}"] = {
            "reads": DeviceTensor.reads, "read_at_end": DeviceTensor.read_at_end, "loss": stats.loss,
            "tokens": stats.tokens, "last_stage": parallel_state.is_pipeline_last_stage()}


def probe(model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group(backend="gloo")
    out = {"dir": out_dir}
    for pp, dp in ((2, 1), (1, 2)):
        train_one_step(model_dir=model_dir, pp=pp, dp=dp, out=out)
    out.pop("dir")
    (Path(out_dir) / f"rank{dist.get_rank()}.json").write_text(json.dumps(out))
    dist.barrier()


def test_the_counter_sees_a_read_back():
    """The counter itself: a read of a DeviceTensor, or of anything computed from it, is recorded."""
    from toolkit.train.engine.tasks import CausalLM

    DeviceTensor.reads = []
    batch = to_fake_device(micro_batches(packed=False, count=1, vocab=50))[0]
    CausalLM(vocab_size=50).count(batch)  # `.item()` of the mask's sum: what the step must no longer do
    int((batch["tokens"] * 2).max())
    assert [name for name, _ in DeviceTensor.reads] == ["item", "__int__"]


def test_a_step_reads_nothing_back_before_its_end(tiny_llama, tmp_path):
    from ranks import run_on_ranks

    run_on_ranks(__file__, tiny_llama, tmp_path, nprocs=2, timeout=600)
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for case, found in report.items():
            print(f"rank {rank} {case}: loss {found['loss']:.4f}, {found['tokens']} tokens, reads {found['reads']}")
            assert found["reads"] == [], f"{case}: the step read the device back at {found['reads']}"
            assert found["read_at_end"] > 0 or not found["last_stage"]  # the loss did come from DeviceTensors
            assert found["tokens"] == 2 * 2 * 32 * (2 if case.startswith("pp1-dp2") else 1)  # the global units
            assert 0 < found["loss"] < 20


if __name__ == "__main__":
    probe(*sys.argv[1:])
