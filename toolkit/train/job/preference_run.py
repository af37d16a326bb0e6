"""What `training.method: dpo` adds to a run (toolkit/train/job/run.py): the DPO task, its reference, and the
reference log-probs precomputed once over the data (`training.dpo.reference: precomputed`).

    reference: base, LoRA         the policy with its adapters off: no second copy, one more forward per step
    reference: base, full tuning  a frozen copy of the starting checkpoint at the policy's TP x PP (not ZeRO
                                  partitioned: each model-parallel rank holds its shard whole, in the run's dtype)
    reference: PATH               a frozen copy of that checkpoint, the same way
    reference: precomputed        before training, one forward pass of the starting model (adapters off) over every
                                  pair, written next to the data cache (`reference-logps-<key>.npy`, [pairs, 2]) and
                                  read by later runs on the same data and model; training then holds one model
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from toolkit import backend as backends
from toolkit.errors import DsmtError
from toolkit.spec.preference import dpo_settings, preference_settings


def dpo_task_and_reference(*, spec, layout, info, params_dtype: torch.dtype, attention: str | None):
    """(the preference task, DPO's LiveReference or None) for a dpo / simpo / orpo spec; (None, None) for SFT.
    Collective (a frozen copy is loaded by every rank)."""
    from toolkit.train.engine.preference import Dpo, LiveReference, Orpo, Simpo

    found = preference_settings(spec.training)
    if found is None:
        return None, None
    method, settings = found
    if info.settings.encoder is not None:  # `dsmt check` says so first (rule dpo_model)
        raise DsmtError(f"training.method={method}: {info.hf_dir} is an encoder ({info.settings.encoder.task} head); "
                        "preference methods train causal language models; set training.method: sft or use a causal "
                        "LM checkpoint")
    task = {"dpo": Dpo, "simpo": Simpo, "orpo": Orpo}[method](vocab_size=info.settings.vocab_size, settings=settings)
    if method != "dpo":  # reference-free
        return task, None
    dpo = settings
    if dpo.reference == "precomputed":
        return task, None
    if dpo.reference == "base" and spec.training.lora is not None:
        if spec.training.lora.train_embeddings:  # `dsmt check` says so first (rule dpo_lora_embeddings)
            raise DsmtError("training.lora.train_embeddings with training.dpo.reference=base: the trained embeddings "
                            "are not adapters, so the reference would move with the policy; set "
                            "training.dpo.reference: precomputed or the starting checkpoint's path")
        return task, LiveReference(chunks=None)
    where = Path(dpo.reference_path or info.hf_dir)
    return task, LiveReference(chunks=frozen_chunks(checkpoint=where, layout=layout, params_dtype=params_dtype,
                                                    attention=attention, fusions=spec.training.fusions))


def frozen_chunks(*, checkpoint: Path, layout, params_dtype: torch.dtype, attention: str | None,
                  fusions: str = "auto") -> list:
    """This rank's chunks of `checkpoint` for forward passes only: no gradient, eval mode, whole on the rank."""
    from toolkit.convert.chunks import load_model_chunks

    chunks, _ = load_model_chunks(checkpoint=checkpoint, layout=layout, params_dtype=params_dtype,
                                  attention=attention, fusions=fusions)
    for chunk in chunks:
        chunk.requires_grad_(False)
        chunk.eval()
    return chunks


def reference_key(*, hf_dir: Path, precision: str) -> str:
    """What the precomputed log-probs depend on beyond the data (whose cache directory holds them): the starting
    checkpoint's files, in sub-folders too (a dsmt megatron checkpoint's `model/`), by name, size and modification
    time, and the precision they were computed in. Rank 0's view alone decides (nodes may hold their own copies)."""
    root = Path(hf_dir)
    files = sorted(p for p in root.rglob("*") if p.is_file())
    described = [str(root.resolve()), precision] + [[str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns]
                                                    for p in files]
    return hashlib.sha256(json.dumps(described).encode()).hexdigest()[:16]


def precomputed_table(*, hybrid, examples, layout, hf_dir: Path, precision: str) -> torch.Tensor:
    """[pairs, 2] reference log-probs (chosen, rejected) of `examples`: read from the data cache by rank 0 and sent
    to every rank, or computed now with the starting model (before any checkpoint is loaded: the policy is still the
    reference) and written there by rank 0. Collective."""
    import torch.distributed as dist

    from toolkit.train.engine.preference import LiveReference

    if examples.directory is None:
        raise DsmtError("training.dpo.reference=precomputed needs the data cache (records read from data.path); "
                        "set training.dpo.reference: base")
    found = [None]
    if dist.get_rank() == 0:
        path = Path(examples.directory) / f"reference-logps-{reference_key(hf_dir=hf_dir, precision=precision)}.npy"
        table = torch.from_numpy(np.load(path)) if path.is_file() else None
        found = [table if table is not None and tuple(table.shape) == (len(examples), 2) else None]
    dist.broadcast_object_list(found, src=0)  # one answer for every rank, whatever each node's files
    if found[0] is not None:
        return found[0]
    table = _forward_table(hybrid=hybrid, examples=examples, layout=layout, reference=LiveReference(chunks=None))
    if dist.get_rank() == 0:
        _write_atomically(path, table.numpy())
        print(f"dsmt train: reference log-probs of {len(examples)} pairs written to {path}", flush=True)
    dist.barrier()
    return table


def precomputed_reference(*, spec, layout, hybrid, examples, hf_dir: Path, batches=None):
    """`examples`' precomputed reference log-probs (training.dpo.reference: precomputed) as a
    `PrecomputedReference` over `batches` (None for validation rows, which it serves through `add`); None for any
    other reference. Collective; call it before any checkpoint is loaded (the policy is then the reference)."""
    dpo = dpo_settings(spec.training)
    if dpo is None or dpo.reference != "precomputed":
        return None
    from toolkit.train.engine.preference import PrecomputedReference

    table = precomputed_table(hybrid=hybrid, examples=examples, layout=layout, hf_dir=hf_dir,
                              precision=spec.training.precision)
    return PrecomputedReference(batches=batches, table=table)


PRECOMPUTE_MICRO_BATCHES = 64  # per forward pass (times pp with virtual stages): host memory stays a chunk's


def _forward_table(*, hybrid, examples, layout, reference) -> torch.Tensor:
    """Every pair once, dealt over the data-parallel ranks as validation rows are (every rank the same number of
    micro-batches), a chunk of micro-batches at a time; the last stage's TP rank 0 of each replica fills its pairs,
    and a sum over the world gives every rank the whole table."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from toolkit.train.engine.preference import REFERENCE_KEY
    from toolkit.train.job.eval_rows import preference_rows, rank_rows

    multiple = layout.pp if len(hybrid.chunks) > 1 else 1
    rows = rank_rows(num_examples=len(examples), dp_rank=parallel_state.get_data_parallel_rank(), dp_size=layout.dp,
                     micro_batch_size=layout.micro_batch_size, microbatch_multiple=multiple)
    writes = (parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
              and parallel_state.get_context_parallel_rank() == 0)
    table = torch.zeros(len(examples), 2, dtype=torch.float64)
    step = PRECOMPUTE_MICRO_BATCHES * multiple
    for start in range(0, len(rows), step):
        micro_batches = [preference_rows(examples, chunk) for chunk in rows[start:start + step]]
        reference.add_logps(hybrid, micro_batches)
        for batch in micro_batches if writes else ():
            real = batch["pair_mask"].bool()
            table[batch["pair_index"][real]] = batch[REFERENCE_KEY].double().cpu().view(-1, 2)[real]
    summed = table.to(backends.current().device)  # NCCL reduces device tensors only
    dist.all_reduce(summed)
    return summed.cpu()


def _write_atomically(path: Path, array: np.ndarray) -> None:
    handle, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".npy", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as file:
            np.save(file, array)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
