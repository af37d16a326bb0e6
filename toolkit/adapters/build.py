"""Build this rank's megatron-core `GPTModel` chunk(s) for a layout (weights are loaded by `load.py`)."""

from __future__ import annotations

import torch

from toolkit import backend as backends
from toolkit.adapters.hf_config import ModelSettings
from toolkit.adapters.layer_specs import (decoder_spec, is_local_spec, layer_spec, local_layer_spec,  # noqa: F401
                                          per_layer_specs, uses_te_layers, with_local_checkpoint_keys)
from toolkit.adapters.norms import TorchNorm  # noqa: F401 (tests read build.TorchNorm)
from toolkit.adapters.vocab_mask import mask_padded_vocab
from toolkit.parallel.groups import Layout


# training.recompute -> megatron's activation recompute settings (selective: core attention only).
RECOMPUTE = {
    "none": {},
    "selective": {"recompute_granularity": "selective"},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
}


def transformer_config(*, settings: ModelSettings, layout: Layout, params_dtype: torch.dtype, init_weights: bool = False,
                       init_method_std: float = 0.02, recompute: str = "none", attention: str | None = "local",
                       fusions: str = "auto"):
    """megatron's TransformerConfig for this model and layout; `attention` as for `layer_spec` (the fusions
    depend on the layers: toolkit/adapters/fusions.py; the default builds no fusion that needs TE's layers);
    `fusions` is training.fusions ("off": none)."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    from toolkit.adapters.fusions import fusion_fields
    from toolkit.adapters.longrope import scale_rotation

    backend = backends.current()
    flags = fusion_fields(settings=settings, device=backend.name, te_layers=uses_te_layers(attention), fusions=fusions)
    # Multi-latent attention (DeepSeek) reads its shapes and its own RoPE from megatron's MLA config class.
    config_class = MLATransformerConfig if settings.transformer_fields.get("multi_latent_attention") else TransformerConfig
    config = config_class(
        # shapes, and the family's deltas (activation, norm, biases, qk-norm); the fused kernels this machine has
        **{**settings.transformer_fields, **flags},
        tensor_model_parallel_size=layout.tp,
        # Norm and residual activations split along the sequence over the TP ranks; the norms' gradients are then
        # partial per rank and the engine sums them over TP (`toolkit.train.engine.tp_grads.sum_sequence_parallel_grads`).
        sequence_parallel=layout.sp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        # Ring attention over cp ranks: Transformer Engine's attention only (layer_spec refuses cp with local layers).
        context_parallel_size=layout.cp,
        # MoE: each rank builds num_experts / ep experts; the experts' own TP size defaults to tp.
        expert_model_parallel_size=layout.ep,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        # Weights come from the checkpoint: random initialisation would only cost time (minutes at 70B).
        perform_initialization=init_weights,
        # With init_weights: normal(0, std) everywhere, std / sqrt(2 * num_layers) for the two output projections.
        init_method_std=init_method_std,
        use_cpu_initialization=backend.name == "cpu",
        batch_p2p_comm=backend.batch_p2p_comm,
        **RECOMPUTE[recompute],
    )
    scale_rotation(config, rope_scaling=settings.rope_scaling)  # long-RoPE's factor on cos / sin (partial rotary)
    return config


def attention_for(*, settings: ModelSettings, attention: str | None) -> str | None:
    """The attention kind to build: the caller's; when it leaves the choice to the machine (verify, convert: None),
    local for a model with softcapped scores or a family whose layers exist only there (Architecture.local_layers_only:
    Qwen3-Next, Llama 4): only megatron's local attention has them (TE's would be refused)."""
    local_only = settings.attention_softcap is not None or settings.family.architecture.local_layers_only
    if attention is None and local_only:
        return "local"
    return attention


def build_model_chunks(*, settings: ModelSettings, layout: Layout, params_dtype: torch.dtype = torch.float32,
                       parallel_output: bool = True, init_weights: bool = False, init_method_std: float = 0.02,
                       recompute: str = "none", attention: str | None = None, fusions: str = "auto") -> list:
    """This rank's model chunks (one per virtual stage), on the backend's device.

    `parallel_output=False` gathers the vocab-parallel logits on every TP rank (verification); training keeps
    them split for megatron's vocab-parallel cross entropy. `fusions`: training.fusions; "off" also keeps
    megatron's other compiled helpers eager in this process (toolkit/adapters/fusions.py `run_megatron_eagerly`)."""
    attention = attention_for(settings=settings, attention=attention)
    config = transformer_config(settings=settings, layout=layout, params_dtype=params_dtype, init_weights=init_weights,
                                init_method_std=init_method_std, recompute=recompute, attention=attention,
                                fusions=fusions)
    if fusions == "off":
        from toolkit.adapters.fusions import run_megatron_eagerly

        run_megatron_eagerly()
    device = backends.current().device
    chunks = []
    for model in model_chunks(config=config, settings=settings, layout=layout, attention=attention,
                              parallel_output=parallel_output):
        mark_tensor_parallel_weights(model)
        chunks.append(model.to(device))
    return chunks


def model_chunks(*, config, settings: ModelSettings, layout: Layout, attention: str | None, parallel_output: bool):
    """This rank's models per virtual stage: `GPTModel`s, or for an encoder family (BERT) the post-LN encoder of
    toolkit/adapters/encoder.py with the checkpoint's head."""
    if settings.encoder is not None:
        from toolkit.adapters.encoder import check_encoder_attention, encoder_chunks

        check_encoder_attention(attention=attention, cp_size=layout.cp)
        return encoder_chunks(config=config, settings=settings, vpp_size=layout.vpp, parallel_output=parallel_output)
    moe_layers = settings.moe_layers
    kinds = {"moe": settings.num_experts} if moe_layers else {}  # the spec of each kind of layer the model has
    kinds |= {"dense": 0} if len(moe_layers) < settings.num_layers else {}
    specs = {kind: family_layer_spec(config=config, settings=settings, attention=attention, cp_size=layout.cp,
                                     num_experts=num_experts) for kind, num_experts in kinds.items()}
    spec = per_layer_specs(dense=specs.get("dense"), moe=specs.get("moe"), moe_layers=moe_layers,
                           num_layers=settings.num_layers)
    return gpt_chunks(config=config, spec=spec, settings=settings, vpp_size=layout.vpp, parallel_output=parallel_output)


def family_layer_spec(*, config, settings: ModelSettings, attention: str | None, cp_size: int, num_experts: int):
    """One layer's spec (MoE with `num_experts`, else dense) with the family's deltas: residual multiplier and the
    family's own spec edits."""
    spec = layer_spec(attention=attention, cp_size=cp_size, qk_norm=settings.family.architecture.qk_norm,
                      num_experts=num_experts, mla=bool(settings.transformer_fields.get("multi_latent_attention")))
    spec = with_residual_multiplier(spec, multiplier=settings.multipliers.residual)
    if settings.family.edit_layer_spec is not None:
        spec = settings.family.edit_layer_spec(spec, config=config, settings=settings,
                                               transformer_engine=not is_local_spec(spec))
    return spec


def gpt_chunks(*, config, spec, settings: ModelSettings, vpp_size: int, parallel_output: bool = True):
    """Yield this rank's `GPTModel` per virtual stage, constructed where the caller says (device context,
    zero.Init); megatron's parallel state decides which stages hold the embedding and the output layer."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from toolkit.adapters.packed import use_position_ids_for_rope
    from toolkit.adapters.window import keep_explicit_masks_windowed

    architecture = settings.family.architecture
    rope = architecture.position_embedding == "rope"
    rope_kwargs = dict(settings.rope_scaling or {})
    longrope = rope_kwargs.pop("longrope", None)  # Phi-3 long-RoPE: its own rotary module (toolkit/adapters/longrope.py)
    linear_factor = rope_kwargs.pop("linear_factor", None)  # HF's linear RoPE scaling
    for vp_stage in range(vpp_size):
        vp = vp_stage if vpp_size > 1 else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=decoder_spec(config=config, layer_spec=spec, vp_stage=vp),
            vocab_size=settings.padded_vocab_size,
            max_sequence_length=settings.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            parallel_output=parallel_output,
            share_embeddings_and_output_weights=settings.tied_embeddings,
            position_embedding_type=architecture.position_embedding,
            vp_stage=vp,
            **({"rotary_base": settings.rotary_base, **rope_kwargs} if rope else {}),
        )
        if architecture.embedding_scale and model.pre_process:
            model.embedding.register_forward_hook(EmbeddingScale(settings.transformer_fields["hidden_size"]))
        if longrope is not None:
            from toolkit.adapters.longrope import longrope_rotary

            model.rotary_pos_emb = longrope_rotary(model=model, longrope=longrope)
        if linear_factor is not None:  # HF: inv_freq /= factor (megatron's own interpolation rounds differently)
            model.rotary_pos_emb.inv_freq = model.rotary_pos_emb.inv_freq / linear_factor
        multipliers = settings.multipliers
        if multipliers.embedding != 1.0 and model.pre_process:
            model.embedding.register_forward_hook(EmbeddingMultiplier(multipliers.embedding))
        if multipliers.logits_divisor != 1.0 and model.post_process:
            model.output_layer.register_forward_hook(LogitsDivisor(multipliers.logits_divisor))
        if settings.family.edit_model is not None:
            settings.family.edit_model(model, settings=settings)
        if model.post_process:  # last: after every hook that changes the logits (Gemma 2's softcap maps -inf)
            mask_padded_vocab(model.output_layer, settings=settings)
        if rope:  # packed records: RoPE at the batch's position ids, which restart per record
            use_position_ids_for_rope(model)
        keep_explicit_masks_windowed(model)  # packed records' masks on windowed local layers
        yield model


class EmbeddingScale:
    """Forward hook on megatron's embedding: multiply its output by sqrt(hidden_size), as Gemma does (HF rounds the
    factor to the activations' dtype first; so does this). megatron-core's GPTModel has no embedding multiplier.
    Applied after megatron's embedding dropout (HF: before); the families that scale use no dropout."""

    def __init__(self, hidden_size: int):
        self.factor = hidden_size**0.5

    def __call__(self, module, inputs, output: torch.Tensor) -> torch.Tensor:
        return output * torch.tensor(self.factor, dtype=output.dtype, device=output.device)


class EmbeddingMultiplier:
    """Forward hook on megatron's embedding: multiply its output by a config scalar (Granite's
    `embedding_multiplier`; HF multiplies by the Python float, as here). After megatron's embedding dropout (HF:
    before); Granite has no embedding dropout."""

    def __init__(self, factor: float):
        self.factor = float(factor)

    def __call__(self, module, inputs, output: torch.Tensor) -> torch.Tensor:
        return output * self.factor


class LogitsDivisor:
    """Forward hook on megatron's output layer (output `(logits, bias)`): logits divided by a config scalar
    (Granite's `logits_scaling`). Elementwise, so exact on vocab-parallel shards and before the loss."""

    def __init__(self, divisor: float):
        self.divisor = float(divisor)

    def __call__(self, module, inputs, output):
        logits, bias = output
        return logits / self.divisor, bias


def with_residual_multiplier(spec, *, multiplier: float):
    """The layer spec with each sublayer's output (attention after linear_proj, MLP after linear_fc2, their biases
    included) multiplied by `multiplier` before the residual add (Granite's `residual_multiplier`: HF computes
    `residual + sublayer(x) * m`). Done in the layer's bias-dropout-add, which local and Transformer Engine layers
    share, so LoRA's delta on linear_proj / linear_fc2 is scaled too, as in HF."""
    import dataclasses

    if multiplier == 1.0:
        return spec
    bda = scaled_bias_dropout_add(multiplier)
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attn_bda=bda, mlp_bda=bda))


def scaled_bias_dropout_add(multiplier: float):
    """megatron's `get_bias_dropout_add` with the (output, bias) pair scaled first. A plain function: megatron's
    `build_module` hands functions to the layer uncalled, and the layer calls it as `bda(training, fused)(...)`."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

    def bias_dropout_add(training: bool, fused: bool):
        add = get_bias_dropout_add(training, fused)

        def scaled(x_with_bias, residual, prob):
            output, bias = x_with_bias
            return add((output * multiplier, None if bias is None else bias * multiplier), residual, prob)

        return scaled

    return bias_dropout_add


def mark_tensor_parallel_weights(model: torch.nn.Module) -> None:
    """Give every TP-sharded weight megatron's `tensor_model_parallel` / `partition_dim` attributes.

    megatron's local layers set them only inside their random initialisation, which we skip when weights come from a
    checkpoint. Without them DeepSpeed counts each shard as a replicated parameter: the gradient norm sums over TP
    ranks wrongly (so clipping is wrong) and the bf16 optimizer mis-partitions. Weights that already carry the
    attributes (Transformer Engine layers, or megatron's own initialisation) are left as they are."""
    from megatron.core.tensor_parallel import layers

    for module in model.modules():
        if isinstance(module, (layers.ColumnParallelLinear, layers.VocabParallelEmbedding)):
            partition_dim = 0
        elif isinstance(module, layers.RowParallelLinear):
            partition_dim = 1
        else:
            partition_dim = {"column": 0, "row": 1}.get(getattr(module, "parallel_mode", None))
        weight = getattr(module, "weight", None)
        if partition_dim is None or not isinstance(weight, torch.nn.Parameter):
            continue
        if not any(hasattr(weight, name) for name in ("tensor_model_parallel", "partition_dim", "partition_stride")):
            layers.set_tensor_model_parallel_attributes(weight, True, partition_dim, 1)
