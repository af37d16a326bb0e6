"""`dsmt check`'s reading of a checkpoint's config through the adapters (the same reading as `dsmt train --dry-run`
and the model loader): what only the model family knows."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from toolkit.errors import DsmtError
from toolkit.layout_rules import ModelFacts, layout_problems
from toolkit.shapes import ModelShape
from toolkit.spec.layout import parallel_layout, spec_model_type
from toolkit.spec.report import Problem
from toolkit.spec.schema import JobSpec


def check_model_adapter(*, spec: JobSpec, shape: ModelShape) -> list[Problem]:
    """The adapters' reading of a checkpoint's config, as the dry run and the loader read it: every field its family
    cannot reproduce, and the layout rules only the family knows (OLMo-2's q / k norms over all heads, Gemma 2's
    softcapped attention); the shape's own rules are check_layout's."""
    from toolkit.adapters.family import get_family, supported_model_types
    from toolkit.adapters.hf_config import load_hf_config, model_settings
    from toolkit.spec.checks import spec_run_facts  # checks.py lists this check

    model_type = spec_model_type(spec) if spec.model.path is not None else None
    if model_type not in supported_model_types() or get_family(model_type).is_encoder:
        return []  # builtin shapes and inline configs: the dry run reads them; encoders: check_encoder_model
    try:  # config.json only (the weights are the dry run's and the loader's)
        settings = model_settings(load_hf_config(Path(spec.model.path)),
                                  vocab_pad_multiple=spec.model.make_vocab_size_divisible_by)
    except DsmtError as err:
        return [Problem("error", "model_config", str(err), "use a config the family reproduces (the message "
                        "names each field), or another checkpoint")]
    base = ModelFacts.from_shape(shape, vocab_multiple=spec.model.make_vocab_size_divisible_by)
    family = ModelFacts.from_settings(settings)
    refined = dataclasses.replace(base, kv_heads_replicable=family.kv_heads_replicable,
                                  attention_softcap=family.attention_softcap)
    shape_rules = {(p.rule, p.message) for p in layout_problems(layout=parallel_layout(spec), model=base,
                                                                 run=spec_run_facts(spec))}
    return [p for p in layout_problems(layout=parallel_layout(spec), model=refined, run=spec_run_facts(spec))
            if (p.rule, p.message) not in shape_rules]
