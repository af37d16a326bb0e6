"""GPT-OSS (HF `GptOssForCausalLM`: gpt-oss-20b / 120b): Mixtral's MoE decoder (families/moe.py) with

  attention   biases on q / k / v / o (`attention_bias`), GQA, and a learnable sink per head (`self_attn.sinks`): one
              more logit joins each row's softmax and is dropped after it. megatron-core's `softmax_type="learnable"`
              (local `DotProductAttention`: `SoftmaxOne` over [scores, sink] with the sink of each of this TP rank's
              heads, `core_attention.softmax_offset`, split over TP by head as the fused QKV is); Transformer Engine's
              attention takes the same field from TE 2.8 on (older TE is refused by name).
  windows     `layer_types`: sliding (window `sliding_window`) and full layers alternate (toolkit/adapters/window.py).
  RoPE        YaRN (factor 32 on 4096 positions, truncate false) as released. The inverse frequencies are read
              from transformers' own `GptOssRotaryEmbedding` (so the correction range and its rounding are HF's),
              and put in megatron's plain RotaryEmbedding; HF also multiplies cos and sin by the attention factor
              a (0.1 ln(factor) + 1): the whole head rotates, so each score is scaled by a^2, megatron's
              `softmax_scale` = a^2 / sqrt(head_dim) (toolkit/adapters/longrope.py does the same for Phi-3).
  router      a linear with bias (`mlp.router.weight / bias`), top-k of the logits, softmax over the k chosen:
              megatron's softmax router with `moe_router_pre_softmax=False` (softmax of the top-k logits) and the
              router bias of `add_bias_linear`; in the activations' dtype, as HF.
  experts     SwiGLU with biases and a clamp (`swiglu_limit`, `swiglu_alpha`):
                  gate = min(gate, limit); up = clamp(up, -limit, limit); out = (up + 1) * gate * sigmoid(alpha gate)
              = megatron's unfused GLU with `activation_func_clamp_value=limit`, `glu_linear_offset=1` and the
              activation gate * sigmoid(gate * alpha) (`SigmoidGate`). Its fused quick-GEGLU clamps before adding
              the fc1 bias, so the fusion stays off (toolkit/adapters/fusions.py). HF stores the experts stacked
              and [in, out]: `experts.gate_up_proj` [E, hidden, 2I] with gate and up interleaved on the last dim
              (gate = [..., ::2]), `down_proj` [E, I, hidden], biases [E, 2I] / [E, hidden]: the rows are
              `stacked_experts`, transposed, and the gate/up ones `GATE_UP_INTERLEAVED`.
  expert TP   megatron-core 0.16 refuses expert biases unless the experts' TP size is 1 (each expert-TP rank would
              add the fc2 bias to its partial sum before the sum over ranks). dsmt keeps expert TP = TP: the fc2
              bias is added on expert-TP rank 0 only (`fix_expert_fc2`) and its gradient summed over TP
              (`tensor_parallel_partial_grad`); the config passes megatron's guard with expert_tensor_parallel_size
              1 and gets the true size back before any module is built (`edit_gpt_oss_layer_spec`).

The published weights are MXFP4 (`quantization_config.quant_method: mxfp4`): `dsmt convert hf-to-mcore
--dequantize-mxfp4` reads them as bf16 (toolkit/adapters/mxfp4.py)."""

from __future__ import annotations

import dataclasses

import torch

from toolkit.adapters.config_checks import attention_dropout_problems, layer_type_problems, static_rope_problems
from toolkit.adapters.family import AdapterError, Architecture, ModelFamily, WeightMapping, register
from toolkit.adapters.families.llama import LM_HEAD, ROTARY_BUFFERS
from toolkit.adapters.families.moe import LLAMA_WITHOUT_MLP, moe_fields, moe_problems
from toolkit.adapters.families.qwen2 import QKV_BIAS
from toolkit.adapters.hf_config import rope_parameters
from toolkit.adapters.transforms import Kind
from toolkit.adapters.window import window_fields

M = WeightMapping
A = "model.layers.*.self_attn."
E = "model.layers.*.mlp.experts."
D = "decoder.layers.*."

GPT_OSS_WEIGHTS = LLAMA_WITHOUT_MLP + (QKV_BIAS,) + (
    M(D + "self_attention.linear_proj.bias", Kind.REPLICATED, (A + "o_proj.bias",)),
    M(D + "self_attention.core_attention.softmax_offset", Kind.COLUMN, (A + "sinks",)),
    M(D + "mlp.router.weight", Kind.REPLICATED, ("model.layers.*.mlp.router.weight",)),
    M(D + "mlp.router.bias", Kind.REPLICATED, ("model.layers.*.mlp.router.bias",)),
    M(D + "mlp.experts.*.linear_fc1.weight", Kind.GATE_UP_INTERLEAVED, (E + "gate_up_proj",), transposed=True,
      stacked_experts=True),
    M(D + "mlp.experts.*.linear_fc1.bias", Kind.GATE_UP_INTERLEAVED, (E + "gate_up_proj_bias",),
      stacked_experts=True),
    M(D + "mlp.experts.*.linear_fc2.weight", Kind.ROW, (E + "down_proj",), transposed=True, stacked_experts=True),
    M(D + "mlp.experts.*.linear_fc2.bias", Kind.REPLICATED, (E + "down_proj_bias",), stacked_experts=True),
)

TE_MIN_VERSION = "2.8.0"  # Transformer Engine's attention takes megatron's softmax_type from 2.8 on


@dataclasses.dataclass(frozen=True)
class SigmoidGate:
    """GPT-OSS's gate activation, gate * sigmoid(gate * alpha), written as HF writes it (megatron's quick_gelu is
    the same at alpha = 1.702 with the product the other way round). A picklable, comparable callable."""

    alpha: float

    def __call__(self, gate: torch.Tensor) -> torch.Tensor:
        return gate * torch.sigmoid(gate * self.alpha)


def hf_rope(hf_config) -> tuple[tuple[float, ...], float]:
    """(inverse frequencies, attention factor on cos / sin) of transformers' own GptOssRotaryEmbedding."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    rotary = GptOssRotaryEmbedding(hf_config)
    return tuple(rotary.inv_freq.float().tolist()), float(rotary.attention_scaling)


def read_gpt_oss_quirks(hf_config) -> dict:
    inv_freq, attention_factor = hf_rope(hf_config)
    return {"rope_inv_freq": inv_freq, "rope_attention_factor": attention_factor}


def head_dim(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def read_gpt_oss_config(hf_config) -> dict:
    fields = moe_fields(hf_config, num_experts=hf_config.num_local_experts,
                        ffn_hidden_size=hf_config.intermediate_size, renormalise=True) | window_fields(hf_config)
    fields |= dict(
        moe_router_dtype=None,  # HF's router: logits and the top-k softmax in the activations' dtype
        softmax_type="learnable",
        activation_func=SigmoidGate(float(hf_config.swiglu_alpha)),
        activation_func_clamp_value=float(hf_config.swiglu_limit),
        glu_linear_offset=1.0,
        expert_tensor_parallel_size=1,  # megatron's guard only; the true size is restored (module docstring)
    )
    _, attention_factor = hf_rope(hf_config)
    if attention_factor != 1.0:  # cos and sin scaled by a: every score by a^2
        fields["softmax_scale"] = attention_factor**2 * head_dim(hf_config) ** -0.5
    return fields


def check_gpt_oss_config(hf_config) -> list[str]:
    problems = moe_problems(hf_config, renormalise=True) + static_rope_problems(
        rope_parameters(hf_config), family="gpt_oss", field="rope_parameters", released="released: yarn")
    if not getattr(hf_config, "attention_bias", True):
        problems.append("attention_bias=False: the gpt_oss adapter reproduces the released layout with biases on "
                        "q / k / v / o (megatron's add_bias_linear also gives the router and experts theirs); "
                        "set attention_bias: true")
    return (problems + attention_dropout_problems(hf_config, family="gpt_oss", released="released: 0.0")
            + layer_type_problems(hf_config, family="gpt_oss"))


def edit_gpt_oss_layer_spec(spec, *, config, settings, transformer_engine: bool):
    """No submodule changes: the true expert TP size back into the config (megatron's guard saw 1), and Transformer
    Engine's attention refused by name where it cannot take the sinks."""
    config.expert_tensor_parallel_size = config.tensor_model_parallel_size
    if transformer_engine:
        check_te_sinks()
    return spec


def check_te_sinks() -> None:
    from megatron.core.utils import get_te_version, is_te_min_version

    if not is_te_min_version(TE_MIN_VERSION):
        raise AdapterError(f"gpt_oss on Transformer Engine {get_te_version()}: its attention sinks "
                           f"(softmax_type 'learnable') need Transformer Engine >= {TE_MIN_VERSION}; upgrade "
                           "transformer-engine, or set training.attention: local")


def edit_gpt_oss_model(model, *, settings) -> None:
    """HF's RoPE frequencies; the sinks marked as TP-split by head; each expert's fc2 bias added once per expert-TP
    group."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    rotary = model.rotary_pos_emb
    rotary.inv_freq = torch.tensor(settings.quirks["rope_inv_freq"], dtype=torch.float32, device=rotary.inv_freq.device)
    for name, param in model.named_parameters():
        if name.endswith("core_attention.softmax_offset") and not hasattr(param, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(param, True, 0, 1)
    has_experts = any(".mlp.experts." in f".{name}" for name, _ in model.named_parameters())
    if has_experts and fix_expert_fc2(model) == 0:  # grouped-GEMM experts would add each fc2 bias tp times
        raise AdapterError("gpt_oss: no expert fc2 under mlp.experts.local_experts (grouped-GEMM experts?): each "
                           "expert's fc2 bias must be added once per expert-TP group; dsmt builds megatron's "
                           "SequentialMLP experts (moe_grouped_gemm false)")


def fix_expert_fc2(model) -> int:
    """Each expert's fc2 output as megatron-core's expert MLP may use it (returns how many experts' fc2 it found):

    * with expert TP > 1, on expert-TP ranks other than 0 its bias comes back times 0 (kept in the graph, so every
      rank's gradient hook fires): the expert-TP sum then holds the bias once, as HF's expert. The biases are marked
      for the engine's sum of their gradients over TP;
    * without expert-parallel communication (TP 1, EP 1) megatron's RowParallelLinear returns its output through
      an identity autograd function, and the expert MLP adds the routed bias to it in place, which autograd refuses
      in training ("a view ... modified inplace"): the output comes back as a copy."""
    from megatron.core import parallel_state

    expert_tp = parallel_state.get_expert_tensor_parallel_world_size()
    keep_bias = parallel_state.get_expert_tensor_parallel_rank() == 0
    found = 0
    for name, module in model.named_modules():
        if not (".mlp.experts.local_experts." in f".{name}" and name.endswith("linear_fc2")):
            continue
        found += 1
        if expert_tp > 1 and module.bias is not None:
            module.bias.tensor_parallel_partial_grad = True
        copy_output = not getattr(module, "explicit_expert_comm", False)
        if copy_output or not keep_bias:
            module.register_forward_hook(ExpertFc2Output(copy_output=copy_output, keep_bias=keep_bias))
    return found


@dataclasses.dataclass(frozen=True)
class ExpertFc2Output:
    """Forward hook on an expert's fc2, `(output, bias)` -> (a copy of output, or itself; bias, or bias x 0)."""

    copy_output: bool
    keep_bias: bool

    def __call__(self, module, inputs, output):
        out, bias = output
        out = out.clone() if self.copy_output else out
        return out, bias if bias is None or self.keep_bias else bias * 0.0


GPT_OSS = register(ModelFamily(
    model_type="gpt_oss", hf_architecture="GptOssForCausalLM", weights=GPT_OSS_WEIGHTS, untied_output=LM_HEAD,
    ignored_hf=ROTARY_BUFFERS, architecture=Architecture(linear_bias=True), read_config=read_gpt_oss_config,
    check_config=check_gpt_oss_config, read_quirks=read_gpt_oss_quirks, edit_layer_spec=edit_gpt_oss_layer_spec,
    edit_model=edit_gpt_oss_model,
))
