"""`dsmt check` on preference tuning (`training.method: dpo`, toolkit/spec/preference.py): the data it reads, the
models and layouts it runs on, and a reference checkpoint that fits the policy. Record-level problems (a pair
missing chosen / rejected, every pair identical) are the data checks' (toolkit/check/data_checks.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from toolkit.errors import Problem
from toolkit.models.shapes import ModelShape, ModelShapeError
from toolkit.spec.preference import preference_settings

# the shape fields a reference must share with the policy: its log-probs are compared token by token, and a
# frozen copy is sharded by the policy's layout
SHAPE_FIELDS = ("hidden_size", "num_layers", "num_attention_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size",
                "num_experts", "tied_embeddings")


def check_preference(*, spec, shape: ModelShape | None) -> list[Problem]:
    found = preference_settings(spec.training)
    if found is None:
        return _preference_data_without_dpo(spec)
    method, settings = found
    problems = _dpo_data(spec) + _dpo_layout(spec)
    if method != "dpo":  # SimPO, ORPO: no reference
        return problems
    problems += _lora_reference(spec, reference=settings.reference)
    if shape is not None and settings.reference_path is not None:
        problems += _reference_problems(path=settings.reference_path, shape=shape)
    return problems


def plain_dpo_problems(*, spec, model_type: str) -> list[Problem]:
    """DPO on a model without a megatron-core adapter: refused (the plain engine trains the head's own task)."""
    if preference_settings(spec.training) is None:
        return _preference_data_without_dpo(spec)
    return [Problem("error", "dpo_model", f"training.method={spec.training.method} with model_type {model_type!r}, "
                    "which has no megatron-core adapter: dsmt's DPO runs on the adapters' causal language models",
                    "use a supported causal LM family (`dsmt check` lists them), or training.method: sft")]


def encoder_dpo_problems(*, spec, model_type: str) -> list[Problem]:
    if preference_settings(spec.training) is None:
        return []
    return [Problem("error", "dpo_model", f"training.method={spec.training.method} with the encoder {model_type!r}: "
                    "DPO compares the log-probs of generated completions, which a masked-LM or classification head "
                    "has none of",
                    "use a causal language model checkpoint, or training.method: sft")]


def _preference_data_without_dpo(spec) -> list[Problem]:
    if spec.data.type != "preference":
        return []
    return [Problem("error", "preference_needs_dpo", "data.type=preference with training.method=sft: pairs of "
                    "chosen and rejected completions train with a preference loss", "set training.method: dpo (or "
                    "simpo, orpo), or give SFT records (data.type: completion, messages, ...)")]


def _dpo_data(spec) -> list[Problem]:
    data = spec.data
    if not data.synthetic and data.path is None and data.blend is None and data.mix is None:
        return []  # no source: rule data_source for `dsmt train`; a script's own loop brings its pairs
    if data.synthetic or data.mix is not None or data.is_megatron or data.type != "preference":
        what = ("data.synthetic=true" if data.synthetic else "data.mix" if data.mix is not None
                else "a Megatron corpus" if data.is_megatron else f"data.type={data.type}")
        return [Problem("error", "dpo_data_type", f"training.method={spec.training.method} with {what}: preference "
                        "methods train on pairs of completions", "set data.path to preference records ({prompt, "
                        "chosen, rejected}, strings or message lists) and data.type: preference")]
    return []


def _dpo_layout(spec) -> list[Problem]:
    if spec.parallel.cp > 1:
        return [Problem("error", "dpo_context_parallel", f"training.method={spec.training.method} with parallel.cp="
                        f"{spec.parallel.cp}: a sequence's log-prob is summed on one rank, and context parallelism "
                        "splits it", "set parallel.cp: 1 (sequence_parallel or a larger tp saves activation memory "
                        "instead)")]
    return []


def _lora_reference(spec, *, reference: str) -> list[Problem]:
    lora = spec.training.lora
    if lora is None or not lora.train_embeddings or reference != "base":
        return []
    return [Problem("error", "dpo_lora_embeddings", "training.lora.train_embeddings with training.dpo.reference=base: "
                    "the reference is the model with its adapters off, and the trained embedding and output layer "
                    "are not adapters, so the reference would move with the policy", "set training.dpo.reference: "
                    "precomputed (computed before training) or the starting checkpoint's path, or leave the "
                    "embeddings frozen")]


def _reference_problems(*, path: str, shape: ModelShape) -> list[Problem]:
    from toolkit.adapters.model_shape import load_model_shape

    if not (Path(path) / "config.json").is_file():
        return [Problem("error", "dpo_reference", f"training.dpo.reference={path!r} is neither base, precomputed nor "
                        "an HF checkpoint folder (no config.json there)", "point it at the reference checkpoint, "
                        "or set base (the starting model) or precomputed")]
    try:
        reference = load_model_shape(path)
    except ModelShapeError as err:
        return [Problem("error", "dpo_reference", f"training.dpo.reference={path!r}: {err}", "point it at an HF "
                        "checkpoint of the policy's architecture")]
    policy, other = dataclasses.asdict(shape), dataclasses.asdict(reference)
    differ = [f"{name} {other[name]} (policy {policy[name]})" for name in SHAPE_FIELDS if policy[name] != other[name]]
    if differ:
        return [Problem("error", "dpo_reference", f"training.dpo.reference={path!r} differs from the policy: "
                        + ", ".join(differ), "give a reference of the policy's shapes (usually the SFT checkpoint "
                        "the policy starts from), or set training.dpo.reference: base")]
    return []
