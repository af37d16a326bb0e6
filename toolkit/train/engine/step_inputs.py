"""A step's micro-batches made ready before any kernel of the step is queued: what the host must know about them is
read from the host tensors, then they are copied to the device without a host wait.

A value read back from the GPU (`.item()`, `.tolist()`, `int(t)`, a Python `if` on a tensor) waits for every
kernel queued before it. Inside megatron's 1F1B schedule such a wait stalls the pipeline: the host cannot queue the
next micro-batch's kernels (nor post the p2p sends the next stage waits on) until the GPU has drained. So the facts
the step needs on the host are taken where the batch still is on the host:

  units       the task's loss units of the micro-batch (toolkit/train/engine/tasks.py `count`): summed over the
              rank's micro-batches on the host, then summed over the data-parallel ranks ON THE DEVICE; the
              per-unit scale of the loss stays a device tensor (`loss_scale`), read back only with the step's loss
              after the optimizer step;
  packed      whether some row holds several records (position ids restart): picks the model call (causal, a
              block-diagonal mask, or THD) without reading the device;
  cu_seqlens  for Transformer Engine's THD layout, the record boundaries of the micro-batch flattened to one row
              (int32) and the longest record, built on the host and copied with the batch.

Batches given already on the device (a script's own, `toolkit.api.initialize`) are read where they are: one wait
per micro-batch before the step starts; CPU batches (the loader's) cost none.
"""

from __future__ import annotations

import dataclasses

import torch

from toolkit import backend as backends
from toolkit.errors import DsmtError

FACTS_KEY = "dsmt_facts"  # the key of a micro-batch's `BatchFacts` in the batch dict (not a tensor: never moved)
_CU_SEQLENS_KEY = "dsmt_cu_seqlens"  # only while copying


@dataclasses.dataclass(frozen=True)
class BatchFacts:
    units: int | None  # the task's loss units in this micro-batch (all of it: before the context-parallel cut)
    packed: bool  # some row holds more than one record
    cu_seqlens: torch.Tensor | None = None  # int32 [records + 1], on the batch's device; None unless packed
    max_seqlen: int | None = None  # the longest record; None unless packed


def batch_facts(batch: dict, *, count=None) -> BatchFacts:
    """The facts of one micro-batch from its tensors where they are (the host, for the loader's batches).
    `count(batch)`: its loss units (the task's); None: not counted (a model call needs only the packing)."""
    from toolkit.adapters import packed as packing

    units = None if count is None else count(batch)
    positions = batch.get("position_ids")
    if positions is None or not packing.has_packed_boundary(positions):
        return BatchFacts(units=units, packed=False)
    cu_seqlens, max_seqlen = packing.record_boundaries(positions)
    return BatchFacts(units=units, packed=True, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)


def on_device(micro_batches: list[dict], *, count) -> list[dict]:
    """The micro-batches on this rank's device (new dicts), each with its `BatchFacts` under FACTS_KEY, read
    before the copy (see the module docstring); a batch that has its facts keeps them. `count`: as for
    `batch_facts`."""
    facts = [facts_of(batch) or batch_facts(batch, count=count) for batch in micro_batches]
    payload = [{**_tensors(batch), **({_CU_SEQLENS_KEY: f.cu_seqlens} if f.packed else {})}
               for batch, f in zip(micro_batches, facts)]
    moved = backends.current().to_device(payload)
    for batch, f in zip(moved, facts):
        cu_seqlens = batch.pop(_CU_SEQLENS_KEY, None)
        batch[FACTS_KEY] = dataclasses.replace(f, cu_seqlens=cu_seqlens)
    return moved


def facts_of(batch: dict) -> BatchFacts | None:
    return batch.get(FACTS_KEY)


def _tensors(batch: dict) -> dict:
    return {key: value for key, value in batch.items() if key != FACTS_KEY}


def global_units(micro_batches: list[dict], *, device: torch.device) -> torch.Tensor:
    """int64 [1] on `device`: the loss units of the step's global batch, summed from the micro-batches' host-read
    facts over the replicas (`replica_sum`). Nothing is read back to the host."""
    return replica_sum(sum(facts_of(batch).units for batch in micro_batches), device=device)


def replica_sum(value: int, *, device: torch.device) -> torch.Tensor:
    """int64 [1] on `device`: `value` summed over the data-parallel replicas, the group without CP (a replica's CP
    ranks hold the same micro-batches, so each counts its whole ones once)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    # a fill kernel: `torch.tensor([value], device=...)` would copy from pageable memory, which waits for the GPU
    total = torch.full((1,), value, dtype=torch.int64, device=device)
    dist.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=False))
    return total


def loss_scale(units: torch.Tensor, *, dp_size: int) -> torch.Tensor:
    """float64 [] on the units' device: dp_size / max(units, 1), what each micro-batch's loss SUM is multiplied by
    (toolkit/train/engine/hybrid.py: DeepSpeed's data-parallel mean divides by dp_size again). In float64, as the
    Python float it replaces, so the backpropagated values are the same bits."""
    return dp_size / units.double().clamp(min=1).reshape(())


def without_facts(batch: dict) -> tuple[dict, BatchFacts | None]:
    """(the batch's tensors, its facts): for code that treats every value of a batch as a tensor."""
    return _tensors(batch), facts_of(batch)


def context_parallel_slices(micro_batches: list[dict]) -> list[dict]:
    """This CP rank's part of every sequence, as megatron-core's `get_batch_on_this_cp_rank` cuts it: 2·cp chunks,
    chunk r and chunk 2·cp-1-r on rank r (balancing causal attention's work). Tokens, labels, loss mask and
    positions are cut alike; RoPE is computed for the full length inside GPTModel and cut the same way. The CP
    ranks of one replica read the same micro-batches (they share megatron's data-parallel rank)."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    if parallel_state.get_context_parallel_world_size() == 1:
        return micro_batches
    cut = []
    for batch in micro_batches:
        tensors, facts = without_facts(batch)  # the facts are of the whole micro-batch: kept as they are
        cut.append({**get_batch_on_this_cp_rank(tensors), **({FACTS_KEY: facts} if facts else {})})
    return cut


def check_sequence_split(*, seq_length: int, chunks: list) -> None:
    """Sequence parallelism splits every sequence into tp equal slices (megatron asserts it deep in a forward)."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    if seq_length % tp and any(getattr(getattr(c, "config", None), "sequence_parallel", False) for c in chunks):
        raise DsmtError(f"sequence_parallel_vs_seq_length: seq_length={seq_length} is not divisible by tp={tp}, "
                        "and sequence parallelism splits each sequence into tp equal slices; set "
                        f"training.seq_length to a multiple of {tp} or parallel.sequence_parallel: false")


def global_loss_tokens(micro_batches: list[dict], *, device: torch.device, count) -> int:
    """Loss units of this rank's micro-batches, whole (before the CP cut), summed over the replicas
    (`replica_sum`), read back to the host: for evaluation, outside the training step. `count(batch)`: a
    micro-batch's loss units (the task's, tasks.py)."""
    return int(replica_sum(sum(count(batch) for batch in micro_batches), device=device).item())
