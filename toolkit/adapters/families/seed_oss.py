"""Seed-OSS (HF `SeedOssForCausalLM`, ByteDance Seed-OSS-36B): the Llama layer with biases on q, k and v
(`attention_bias`, Qwen2's fused linear_qkv.bias) but none on o_proj (`attention_out_bias` false), and a head_dim
that is not hidden_size / heads (5120 / 80 heads x 128).

Its dropouts, as transformers' modeling_seed_oss.py applies them in training (its config class defaults both to
0.1), are megatron-core's own:

* `attention_dropout` on the softmax probabilities: megatron's `attention_dropout` (local and TE attention alike);
* `residual_dropout` on the o_proj output and on the down_proj output, before each residual add: megatron's
  `hidden_dropout`, which its layers apply at exactly those two places (bias-dropout-add). megatron also drops the
  embeddings with `hidden_dropout`; Seed-OSS does not, so `edit_seed_oss_model` turns that dropout off.

Same places and probabilities, so the same training distribution; the random masks of course differ from torch's
in HF. Biases on o_proj alone (`attention_out_bias`) or on the MLP (`mlp_bias`) are refused: megatron puts a bias
on every linear layer or on none of linear_proj / linear_fc1 / linear_fc2."""

from __future__ import annotations

from toolkit.adapters.family import Architecture, ModelFamily, register
from toolkit.adapters.families.llama import LLAMA_WEIGHTS, LM_HEAD, ROTARY_BUFFERS
from toolkit.adapters.families.qwen2 import QKV_BIAS
from toolkit.adapters.hf_config import rope_settings


def _dropout(hf_config, name: str) -> float:
    return float(getattr(hf_config, name, 0.0) or 0.0)


def read_seed_oss_config(hf_config) -> dict:
    return {"add_qkv_bias": bool(hf_config.attention_bias),
            "attention_dropout": _dropout(hf_config, "attention_dropout"),
            "hidden_dropout": _dropout(hf_config, "residual_dropout")}


def read_seed_oss_weights(hf_config) -> tuple:
    """The q / k / v bias row only where the checkpoint has those biases (`attention_bias`, true as released)."""
    return LLAMA_WEIGHTS + ((QKV_BIAS,) if hf_config.attention_bias else ())


def check_seed_oss_config(hf_config) -> list[str]:
    problems = []
    if getattr(hf_config, "attention_out_bias", False):
        problems.append("attention_out_bias=True (a bias on o_proj alone): megatron-core biases every linear layer or "
                        "none of o_proj / the MLP, so the seed_oss adapter reproduces attention_out_bias=false only "
                        "(as released)")
    if getattr(hf_config, "mlp_bias", False):
        problems.append("mlp_bias=True: the seed_oss adapter reproduces mlp_bias=false only (as released)")
    for name in ("attention_dropout", "residual_dropout"):
        if not 0.0 <= _dropout(hf_config, name) < 1.0:
            problems.append(f"{name}={_dropout(hf_config, name)}: a dropout probability is in [0, 1)")
    _, _, rope_problem = rope_settings(hf_config)
    if rope_problem:
        problems.append(rope_problem)
    return problems


def edit_seed_oss_model(model, *, settings) -> None:
    """megatron drops the embeddings with `hidden_dropout` (its residual dropout); Seed-OSS has no embedding dropout."""
    import torch

    if model.pre_process:
        model.embedding.embedding_dropout = torch.nn.Dropout(p=0.0)


SEED_OSS = register(ModelFamily(
    model_type="seed_oss", hf_architecture="SeedOssForCausalLM", weights=LLAMA_WEIGHTS + (QKV_BIAS,),
    untied_output=LM_HEAD, ignored_hf=ROTARY_BUFFERS, architecture=Architecture(qkv_bias=True),
    read_config=read_seed_oss_config, read_weights=read_seed_oss_weights, check_config=check_seed_oss_config,
    edit_model=edit_seed_oss_model,
))
