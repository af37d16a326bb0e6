"""`dsmt check`'s reading of a checkpoint: its weight files' headers (cheap: no tensor data), its family (one
without a megatron-core adapter trains data-parallel only), and its config through the adapters (the same reading
as `dsmt train --dry-run` and the model loader): every config field the model family cannot reproduce. The layout
rules the family decides (OLMo-2's q / k norms over all heads, Gemma 2's softcapped attention) reach check_layout
through the model shape."""

from __future__ import annotations

from pathlib import Path

from toolkit.errors import DsmtError, Problem
from toolkit.models.shapes import ModelShape
from toolkit.spec.layout import spec_model_type
from toolkit.spec.schema import JobSpec


def check_model_adapter(*, spec: JobSpec, shape: ModelShape) -> list[Problem]:
    """The checkpoint's config.json translated by its family, as the dry run and the loader translate it."""
    from toolkit.adapters.family import get_family, supported_model_types
    from toolkit.adapters.hf_config import load_hf_config, model_settings

    model_type = spec_model_type(spec) if spec.model.path is not None else None
    if model_type not in supported_model_types() or get_family(model_type).is_encoder:
        return []  # builtin shapes and inline configs: the dry run reads them; encoders: check_encoder_model
    from toolkit.adapters.hf_source import QuantizedCheckpointError, fp8_block_size, quantization_config

    try:  # config.json only (the weights are the dry run's and the loader's)
        path = Path(spec.model.path)
        fp8_block_size(quantization_config(path), checkpoint_dir=path, dequantize_fp8=False)  # FP8 / quantised
        model_settings(load_hf_config(path), vocab_pad_multiple=spec.model.make_vocab_size_divisible_by)
    except QuantizedCheckpointError as err:
        return [Problem("error", err.rule, err.detail, err.fix)]
    except DsmtError as err:
        return [Problem("error", "model_config", str(err), "use a config the family reproduces (the message "
                        "names each field), or another checkpoint")]
    return []


def check_model_files(*, spec: JobSpec, shape: ModelShape | None) -> list[Problem]:
    """Every safetensors header of model.path readable and every indexed shard present, as the loader will need
    them; a directory with no weight files at all is the dry run's (`dsmt check` also serves config-only specs)."""
    from toolkit.adapters.hf_source import INDEX_NAME, unreadable_weight_files

    path = Path(spec.model.path) if spec.model.path is not None else None
    if path is None or not path.is_dir():
        return []
    if not ((path / INDEX_NAME).is_file() or any(path.glob("*.safetensors"))):
        return []
    return [Problem("error", "checkpoint_unreadable", problem, "")  # the message names the fix
            for problem in unreadable_weight_files(path)]


def no_adapter_problems(*, spec: JobSpec, model_type: str) -> list[Problem]:
    """A model_type without a megatron-core adapter trains with DeepSpeed ZeRO data parallelism only."""
    from toolkit.adapters.family import supported_model_types

    parallel = spec.parallel
    problems = [Problem("info", "plain_model", f"model_type {model_type}: no megatron-core adapter; it trains with "
                        "DeepSpeed ZeRO data parallelism only (tp=1, pp=1)")]
    if parallel.tp > 1 or parallel.pp > 1 or parallel.cp > 1 or parallel.sequence_parallel:
        problems.append(Problem("error", "plain_model_layout",
                                f"tp={parallel.tp}, pp={parallel.pp}, cp={parallel.cp}, sequence_parallel="
                                f"{parallel.sequence_parallel}: model_type {model_type} has no megatron-core adapter "
                                f"(adapters: {', '.join(supported_model_types())})",
                                "set parallel.tp: 1, pp: 1, cp: 1 and sequence_parallel: false, or use a model of "
                                "a family listed"))
    if spec.training.lora is not None:
        problems.append(Problem("error", "lora_needs_adapter", f"training.lora on model_type {model_type}: LoRA "
                                "adapts the megatron-core linears of a transformer family", "remove training.lora "
                                "(full fine-tuning of this model), or fine-tune a supported transformer family"))
    return problems


def check_model_family(*, spec: JobSpec, shape: ModelShape) -> list[Problem]:
    """A checkpoint with a transformer's shape whose model_type has no adapter (gpt_neox, falcon, ...)."""
    from toolkit.adapters.family import supported_model_types

    model_type = spec_model_type(spec) if spec.model.path is not None else None
    if model_type is None or model_type in supported_model_types():
        return []
    return no_adapter_problems(spec=spec, model_type=model_type)
