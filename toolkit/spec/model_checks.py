"""`dsmt check`'s reading of a checkpoint's config through the adapters (the same reading as `dsmt train --dry-run`
and the model loader): every config field the model family cannot reproduce. The layout rules the family decides
(OLMo-2's q / k norms over all heads, Gemma 2's softcapped attention) reach check_layout through the model shape."""

from __future__ import annotations

from pathlib import Path

from toolkit.errors import DsmtError
from toolkit.models.shapes import ModelShape
from toolkit.spec.layout import spec_model_type
from toolkit.spec.report import Problem
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
