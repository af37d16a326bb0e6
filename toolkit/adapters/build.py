"""Build this rank's megatron-core `GPTModel` chunk(s) for a layout (weights are loaded by `load.py`)."""

from __future__ import annotations

import torch

from toolkit import backend as backends
from toolkit.adapters.hf_config import ModelSettings
from toolkit.parallel import Layout


# training.recompute -> megatron's activation recompute settings (selective: core attention only).
RECOMPUTE = {
    "none": {},
    "selective": {"recompute_granularity": "selective"},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
}


def transformer_config(*, settings: ModelSettings, layout: Layout, params_dtype: torch.dtype, init_weights: bool = False,
                       init_method_std: float = 0.02, recompute: str = "none"):
    from megatron.core.transformer import TransformerConfig

    backend = backends.current()
    return TransformerConfig(
        **settings.transformer_fields,
        activation_func=torch.nn.functional.silu,
        tensor_model_parallel_size=layout.tp_size,
        pipeline_model_parallel_size=layout.pp_size,
        virtual_pipeline_model_parallel_size=layout.vpp_size if layout.vpp_size > 1 else None,
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


def layer_spec():
    """Transformer Engine layers where TE is installed (GPU), megatron's local torch layers otherwise."""
    from megatron.core.models.gpt import gpt_layer_specs

    if backends.current().use_transformer_engine:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    return gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")


def build_model_chunks(*, settings: ModelSettings, layout: Layout, params_dtype: torch.dtype = torch.float32,
                       parallel_output: bool = True, init_weights: bool = False, init_method_std: float = 0.02,
                       recompute: str = "none") -> list:
    """This rank's model chunks (one per virtual stage), on the backend's device.

    `parallel_output=False` gathers the vocab-parallel logits on every TP rank (verification); training keeps
    them split for megatron's vocab-parallel cross entropy."""
    config = transformer_config(settings=settings, layout=layout, params_dtype=params_dtype, init_weights=init_weights,
                                init_method_std=init_method_std, recompute=recompute)
    device = backends.current().device
    chunks = []
    for model in gpt_chunks(config=config, spec=layer_spec(), settings=settings, vpp_size=layout.vpp_size,
                            parallel_output=parallel_output):
        mark_tensor_parallel_weights(model)
        chunks.append(model.to(device))
    return chunks


def gpt_chunks(*, config, spec, settings: ModelSettings, vpp_size: int, parallel_output: bool = True):
    """Yield this rank's `GPTModel` per virtual stage, constructed where the caller says (device context,
    zero.Init); megatron's parallel state decides which stages hold the embedding and the output layer."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    for vp_stage in range(vpp_size):
        vp = vp_stage if vpp_size > 1 else None
        yield GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=settings.padded_vocab_size,
            max_sequence_length=settings.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            parallel_output=parallel_output,
            share_embeddings_and_output_weights=settings.tied_embeddings,
            position_embedding_type="rope",
            rotary_base=settings.rotary_base,
            vp_stage=vp,
            **(settings.rope_scaling or {}),
        )


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
