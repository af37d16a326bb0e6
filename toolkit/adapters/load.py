"""Fill this rank's megatron chunks from an HF checkpoint, after checking the whole weight table.

Names: megatron's `sharded_state_dict()` gives every parameter a layout-free key (norms under their fused-layer
names, layers stacked) and the local tensor. dsmt's canonical name is that key with the *global* layer index put
back (`decoder.layers.7.self_attention.linear_qkv.weight`), which is what the families' tables are written in.
The same names hold for the local and the Transformer Engine layer specs, for every PP / VPP stage, and for the
last stage's copy of tied embeddings (megatron keys it as `embedding.word_embeddings.weight`).
"""

from __future__ import annotations

import contextlib
import re
from typing import Callable

import torch
from tqdm import tqdm

from toolkit.adapters import transforms
from toolkit.adapters.family import AdapterError, LoadItem
from toolkit.adapters.hf_config import ModelSettings
from toolkit.adapters.transforms import Kind

# The layer stack: `decoder` in GPTModel, `encoder` in the encoder models (toolkit/adapters/encoder.py).
_LAYER_KEY = re.compile(r"^(decoder|encoder)\.layers\.(\d+)\.")


def full_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """A parameter's shape, also for a DeepSpeed ZeRO-3 parameter (its data is empty outside a gather)."""
    return tuple(getattr(tensor, "ds_shape", tensor.shape))


def canonical_tensors(chunks: list) -> dict[str, torch.Tensor]:
    """Canonical megatron name -> this rank's local tensor (shares storage with the parameter)."""
    found: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        block = chunk.encoder if hasattr(chunk, "encoder") else chunk.decoder
        global_layer = [layer.layer_number - 1 for layer in block.layers]  # layer_number is 1-based, global
        for local_key, item in chunk.sharded_state_dict().items():
            data = getattr(item, "data", None)
            if not isinstance(data, torch.Tensor) or local_key.endswith("_extra_state"):
                continue
            match = _LAYER_KEY.match(local_key)
            if match:
                stack, local_layer = match.group(1), int(match.group(2))
                layer = block.layers[local_layer]
                name = canonical_layer_name(item.key.removeprefix(f"{stack}.layers."), local_key=local_key,
                                            layer=layer)
                found[f"{stack}.layers.{global_layer[local_layer]}.{name}"] = data
            else:
                found[item.key] = data
    return found


# A local expert's parameter: `mlp.experts.local_experts.<local index>.<rest>` in the module tree.
_LOCAL_EXPERT = re.compile(r"^(?:decoder|encoder)\.layers\.\d+\.mlp\.experts\.local_experts\.(\d+)\.(.+)$")


def canonical_layer_name(key: str, *, local_key: str, layer) -> str:
    """The canonical name inside a layer, from megatron's layout-free key.

    An expert's key stacks every expert of the layer (`mlp.experts.experts.linear_fc1.weight`); its canonical name
    is `mlp.experts.<global expert index>.linear_fc1.weight`, the global index being the layer's
    `local_expert_indices` of the module's local one (each EP rank builds num_experts / ep experts). (An MoE layer's
    norm is keyed `mlp.linear_fc1.layer_norm_weight` with either kind of layers: `build.with_local_checkpoint_keys`.)"""
    expert = _LOCAL_EXPERT.match(local_key)
    if expert:
        global_expert = layer.mlp.local_expert_indices[int(expert.group(1))]
        return f"mlp.experts.{global_expert}.{expert.group(2)}"
    return _PER_LAYER_KEY.sub("", key)


# Where dense and MoE layers mix, megatron keys each layer on its own (`<global layer>.<rest>`), not stacked.
_PER_LAYER_KEY = re.compile(r"^\d+\.")


@contextlib.contextmanager
def full_shape_standins(params: list[torch.Tensor]):
    """megatron's `sharded_state_dict()` checks shapes, and a ZeRO-3 parameter's data is empty: inside, each such
    parameter holds a one-element, zero-stride stand-in of its full shape, with storage of its own so that a state
    dict tensor is traced back to its parameter by data pointer. The empty data comes back on exit."""
    saved = []
    try:
        for param in params:
            if hasattr(param, "ds_shape"):
                saved.append((param, param.data))
                param.data = torch.empty(1, dtype=param.dtype, device=param.device).expand(param.ds_shape)
        yield
    finally:
        for param, data in saved:
            param.data = data


def canonical_parameters(chunks: list) -> dict[str, torch.nn.Parameter]:
    """Canonical megatron name -> this rank's parameter object (also when ZeRO-3 has partitioned it)."""
    return parameters_and_buffers(chunks)[0]


def parameters_and_buffers(chunks: list) -> tuple[dict[str, torch.nn.Parameter], dict[str, torch.Tensor]]:
    """(`canonical_parameters`, canonical name -> the checkpoint's tensors that are buffers, not parameters:
    DeepSeek-V3's routing bias, megatron's `expert_bias`, which ZeRO-3 does not partition)."""
    params = [p for chunk in chunks for p in chunk.parameters()]
    with full_shape_standins(params):
        by_pointer = {p.data_ptr(): p for p in params}
        tensors = canonical_tensors(chunks)  # first: megatron's router may re-cast its expert_bias buffer here
        buffers = {b.data_ptr() for chunk in chunks for b in chunk.buffers()}
        unknown = [name for name, t in tensors.items() if t.data_ptr() not in by_pointer and t.data_ptr() not in buffers]
        if unknown:  # a state-dict tensor that is neither: traced wrongly, not to be copied into blindly
            raise AdapterError(f"checkpoint tensors {unknown[:5]} are neither a parameter nor a buffer of the model")
        return ({name: by_pointer[t.data_ptr()] for name, t in tensors.items() if t.data_ptr() in by_pointer},
                {name: t for name, t in tensors.items() if t.data_ptr() in buffers})


def _pattern(name: str) -> re.Pattern:
    return re.compile("^" + re.escape(name).replace(r"\*", r"\d+") + "$")


def passthrough_pattern(entry: str) -> re.Pattern:
    """A `ModelSettings.passthrough_hf` entry as a regex: `*` is a number (as in the weight tables), except a
    trailing `.*`, which is any rest of the name: `model.layers.61.*` is every tensor of layer 61."""
    if entry.endswith(".*"):
        return re.compile(_pattern(entry[:-2]).pattern.removesuffix("$") + r"\..+$")
    return _pattern(entry)


def passthrough_names(*, patterns: tuple[str, ...], names: list[str]) -> list[str]:
    """The names (of a checkpoint's tensors) that `patterns` (`ModelSettings.passthrough_hf`) keep, in order."""
    compiled = [passthrough_pattern(p) for p in patterns]
    return [n for n in names if any(p.match(n) for p in compiled)]


def check_hf_coverage(*, items: dict[str, LoadItem], hf_names: list[str], ignored: tuple[str, ...],
                      passthrough: tuple[str, ...] = ()) -> list[str]:
    """Every HF tensor used, explicitly ignored or passed through (kept, not loaded); every HF tensor the table
    needs present."""
    used = {name for item in items.values() for name in item.hf}
    ignore = [_pattern(p) for p in ignored]
    kept = set(passthrough_names(patterns=passthrough, names=hf_names))
    unexpected = [n for n in hf_names if n not in used and n not in kept and not any(p.match(n) for p in ignore)]
    missing = sorted(used - set(hf_names))
    problems = [f"HF tensor {n!r} is not used by the weight table (unexpected; wrong model_type or a newer variant?)" for n in unexpected]
    problems += [f"HF tensor {n!r} is missing from the checkpoint" for n in missing]
    problems += [f"HF tensor {n!r} is both in the weight table and passed through ({', '.join(passthrough)}): "
                 "the family's read_passthrough must name only tensors the model does not load" for n in sorted(kept & used)]
    return problems


def hf_shape(source, name: str, *, item: LoadItem) -> tuple[int, ...]:
    """The shape of what `item` reads of HF tensor `name`: the tensor, or its expert's slice of a stacked one."""
    shape = tuple(source.shape(name))
    return shape[1:] if item.expert_slice is not None else shape


def read_hf(source, name: str, *, item: LoadItem) -> torch.Tensor:
    """HF tensor `name` as `item` reads it: whole, or its expert's slice of a stacked one (read alone)."""
    if item.expert_slice is None:
        return source.get(name)
    return source.get_expert(name, expert=item.expert_slice)


def hf_nbytes(source, name: str, *, item: LoadItem) -> int:
    """Bytes `item` reads of HF tensor `name` (an expert's share of a stacked one)."""
    return source.nbytes(name) // (source.shape(name)[0] if item.expert_slice is not None else 1)


def stacking_problems(item: LoadItem, *, source, num_experts: int) -> list[str]:
    """A stacked expert tensor must hold the config's experts on dim 0."""
    if item.expert_slice is None or item.expert_slice:  # checked once per tensor, on expert 0's row
        return []
    return [f"HF tensor {name!r} stacks {source.shape(name)[0]} experts on dim 0, the config has {num_experts}"
            for name in item.hf if source.shape(name)[0] != num_experts]


def local_shape(item: LoadItem, hf_shapes: list[tuple[int, ...]], *, settings: ModelSettings, tp_size: int) -> tuple[int, ...]:
    ctx = settings.shape_context()
    shape = list(transforms.megatron_shape(item.kind, hf_shapes, ctx=ctx))
    if item.kind is not Kind.REPLICATED:
        shape[1 if item.kind is Kind.ROW else 0] //= tp_size
    return tuple(shape)


def plan_load(*, settings: ModelSettings, source, targets: dict[str, torch.Tensor], tp_size: int) -> list[LoadItem]:
    """What to read for each local tensor; raises one AdapterError listing every problem found."""
    items = settings.load_items()
    ignored = settings.ignored_hf()
    hf_names = source.names()
    problems = check_hf_coverage(items=items, hf_names=hf_names, ignored=ignored, passthrough=settings.passthrough_hf)
    present, plan = set(hf_names), []
    ctx = settings.shape_context()
    for name, tensor in targets.items():
        item = items.get(name)
        if item is None:
            problems.append(f"megatron parameter {name!r} is not produced by the {settings.family.model_type} weight table")
            continue
        if not all(n in present for n in item.hf):
            continue  # already reported as missing
        problems += stacking_problems(item, source=source, num_experts=settings.num_experts)
        hf_shapes = [transforms.hf_storage_shape(hf_shape(source, n, item=item), transposed=item.transposed)
                     for n in item.hf]
        expected_hf = transforms.expected_hf_shapes(item.kind, transforms.megatron_shape(item.kind, hf_shapes, ctx=ctx), ctx=ctx)
        wrong = [f"{n} {s} (expected {e})" for n, s, e in zip(item.hf, hf_shapes, expected_hf) if tuple(s) != tuple(e)]
        want = local_shape(item, hf_shapes, settings=settings, tp_size=tp_size)
        if wrong or want != full_shape(tensor):
            problems.append(f"shape mismatch for {name}: local {full_shape(tensor)} vs {want} from HF; {'; '.join(wrong) or 'HF shapes as expected'}")
        plan.append(item)
    if problems:
        raise AdapterError(f"{len(problems)} problem(s) between the HF checkpoint and the megatron model:\n  - " + "\n  - ".join(problems))
    return plan


def local_shard(item: LoadItem, hf: list[torch.Tensor], *, settings: ModelSettings, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's tensor from the row's HF tensors (already in [out, in] order)."""
    if item.kind is Kind.GATE_UP:  # straight from gate and up, without building the full [gate ; up]
        return transforms.merge_gate_up(*hf, tp_rank=tp_rank, tp_size=tp_size)
    full = transforms.to_megatron(item.kind, hf, ctx=settings.shape_context())
    return transforms.shard(item.kind, full, tp_rank=tp_rank, tp_size=tp_size)


def _copy_into(target: torch.Tensor, value: Callable[[], torch.Tensor]) -> None:
    target.copy_(value())


@torch.no_grad()
def load_hf_weights(*, chunks: list, settings: ModelSettings, source, tp_rank: int, tp_size: int,
                    show_progress: bool = False, write: Callable | None = None) -> int:
    """Copy HF tensors into this rank's chunks, one at a time. Returns the number of bytes of HF tensors.

    `write(parameter, value)` stores one tensor, `value()` reading and transforming it on demand: the default
    copies into the local tensor; ZeRO-3 passes `toolkit.adapters.zero3.load_partitioned`, which reads on one rank
    of the data-parallel group and broadcasts into the partitions."""
    if write is None:
        targets, writers = canonical_tensors(chunks), {}
    else:  # parameters through `write`, buffers copied
        params, buffers = parameters_and_buffers(chunks)
        targets = {**buffers, **params}
        writers = dict.fromkeys(params, write)
    plan = plan_load(settings=settings, source=source, targets=targets, tp_size=tp_size)
    total = sum(hf_nbytes(source, n, item=item) for item in plan for n in item.hf)
    with tqdm(total=total, unit="B", unit_scale=True, desc="loading HF tensors", disable=not show_progress) as bar:
        for item in plan:
            def value(item=item):
                hf = [transforms.from_hf_storage(read_hf(source, n, item=item), transposed=item.transposed)
                      for n in item.hf]
                return local_shard(item, hf, settings=settings, tp_rank=tp_rank, tp_size=tp_size)

            writers.get(item.megatron, _copy_into)(targets[item.megatron], value)
            bar.update(sum(hf_nbytes(source, n, item=item) for n in item.hf))
    return total
