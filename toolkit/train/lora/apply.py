"""LoRA applied to this rank's chunks (`apply_lora`): the base frozen, an adapter (toolkit/train/lora/adapters.py)
attached to every targeted linear, initialised as PEFT does or from a PEFT adapter directory
(toolkit/train/lora/export.py `read_init_adapter`), and with training.lora.train_embeddings the embedding and output
layer trained whole."""

from __future__ import annotations

import torch

from toolkit.adapters import transforms
from toolkit.train.lora.adapters import LoraAdapter, attach, init_peft, layer_linears
from toolkit.train.lora.export import expert_path, read_init_adapter
from toolkit.train.lora.targets import LINEARS, LoraError, linear_shape, module_shape, resolve_targets


def apply_lora(chunks: list, *, settings, lora, seed: int) -> int:
    """Freeze this rank's chunks and attach the adapters of `lora` (the spec's LoraSpec); returns the number of
    LoRA parameters on this rank. Initialised as PEFT does, or from `lora.init_adapter`. Before `deepspeed.initialize`
    at every ZeRO stage: the adapters are built whole (identical on every rank) and at ZeRO-3 partitioned by it; the
    base weights may already be partitioned (zero.Init), and are only frozen here."""
    from megatron.core import parallel_state

    from toolkit import backend as backends

    modules = resolve_targets(settings.family, lora.targets, rows=settings.rows)
    require_no_expert_dropout(modules, dropout=lora.dropout)
    initial = None
    if lora.init_adapter is not None:
        initial = read_init_adapter(lora.init_adapter, settings=settings, modules=modules, lora=lora)
    groups = {"dense": (parallel_state.get_tensor_model_parallel_rank(),
                        parallel_state.get_tensor_model_parallel_world_size()),
              "expert": (parallel_state.get_expert_tensor_parallel_rank(),
                         parallel_state.get_expert_tensor_parallel_world_size())}
    ep_size = parallel_state.get_expert_model_parallel_world_size()
    device = backends.current().device
    for chunk in chunks:
        for param in chunk.parameters():
            param.requires_grad_(False)
    count = train_embeddings(chunks) if lora.train_embeddings else 0
    for chunk in chunks:
        if chunk.pre_process and chunk.config.recompute_granularity is not None:
            # With the embedding frozen its output needs no gradient, and megatron's (reentrant) recompute then
            # gives none to the LoRA matrices inside a recomputed block: PEFT's `enable_input_require_grads`.
            chunk.embedding.register_forward_hook(_require_grad)
        for layer in chunk.decoder.layers:
            count += _adapt_layer(layer, chunk.config, modules=modules, settings=settings, lora=lora, seed=seed,
                                  initial=initial, groups=groups, ep_size=ep_size, device=device)
    return count


def require_no_expert_dropout(modules, *, dropout: float) -> None:
    """PEFT's LoRA on parameters (`ParamWrapper`: the fused experts, the router) refuses lora_dropout != 0 (the
    delta is added to the weight, so the input cannot be dropped for it alone): an adapter trained with dropout
    there would not be PEFT's."""
    parameters = sorted({module.name for module in modules if module.parameter})
    if parameters and dropout:
        raise LoraError(f"training.lora.dropout={dropout} with the routed experts or the router targeted "
                        f"({', '.join(parameters)}): PEFT adapts those only without dropout; set "
                        "training.lora.dropout: 0, or leave them out of training.lora.targets")


def train_embeddings(chunks: list) -> int:
    """Unfreeze the input embedding (first stage) and the output layer (last stage: the untied head, or at PP > 1
    the tied copy, which the engine keeps equal to the embedding by summing their gradients); returns the number of
    parameters this rank trains there. PEFT's `modules_to_save`: the whole tensor trains, initialised from the base."""
    count = 0
    for chunk in chunks:
        weights = [chunk.embedding.word_embeddings.weight] if chunk.pre_process else []
        if chunk.post_process and chunk.output_layer.weight is not None:
            weights.append(chunk.output_layer.weight)  # None at PP 1 when tied: the embedding's own weight
        for weight in weights:
            weight.requires_grad_(True)
            count += weight.numel()
    return count


def _require_grad(module, inputs, output):
    return output.requires_grad_(True) if not output.requires_grad else output


def _adapt_layer(layer, config, *, modules, settings, lora, seed, initial, groups, ep_size, device) -> int:
    index = layer.layer_number - 1
    count = 0
    for linear in LINEARS:
        chosen = {m.slot: m for m in modules if m.linear == linear
                  and m.in_layer(index, moe_layers=settings.moe_layers)}
        if not chosen:
            continue
        bases = layer_linears(layer, linear)
        if not bases:
            raise LoraError(f"training.lora: layer {index} has no {linear}, which the weight table gives it; "
                            "dsmt's LoRA and the model builder disagree (a bug: report it)")
        kind = next(iter(chosen.values())).kind
        out_rows = [shape[0] for shape in transforms.expected_hf_shapes(
            kind, linear_shape(settings, linear), ctx=settings.shape_context())]
        tp_rank, tp_size = groups["expert" if linear.startswith("mlp.experts.") else "dense"]
        for expert, base in bases:
            adapter = LoraAdapter(linear=linear, kind=kind, modules={s: m.path_for(index) for s, m in chosen.items()},
                                  shapes={s: module_shape(settings, m) for s, m in chosen.items()},
                                  out_rows=out_rows, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                                  ctx=settings.shape_context(), tp_rank=tp_rank, tp_size=tp_size,
                                  sequence_parallel=config.sequence_parallel and expert is None,
                                  dtype=base.weight.dtype, expert=expert)
            _initialise(adapter, initial=initial, seed=seed)
            if expert is not None and ep_size > 1:
                for param in adapter.parameters():  # an expert parameter to DeepSpeed (toolkit/train/engine/moe.py)
                    param.allreduce = False
            attach(base, adapter.to(device))
            count += sum(p.numel() for p in adapter.parameters())
    return count


def _initialise(adapter: LoraAdapter, *, initial: dict | None, seed: int) -> None:
    """From the init adapter (per expert for an expert's: `read_init_adapter` splits PEFT's fused pair), or as
    PEFT initialises (A by a generator seeded by the run seed and the module, and the expert)."""
    for slot, path in adapter.hf_paths.items():
        if adapter.expert is not None:  # the name the init generator is seeded with: the expert's own
            path = expert_path(path, adapter.expert)
        if initial is not None:
            with torch.no_grad():
                adapter.lora_A[str(slot)].copy_(initial[f"{path}.lora_A"])
                adapter.lora_B[str(slot)].copy_(initial[f"{path}.lora_B"])
        else:
            init_peft(adapter.lora_A[str(slot)], seed=seed, hf_path=path)
