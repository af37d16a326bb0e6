"""GPT-OSS pieces alone (one process): the config it reads and the refusals by name, HF's YaRN frequencies, the
stacked expert rows, MXFP4 dequantisation against transformers' own `convert_moe_packed_tensors` on hand-built
blocks and scales, and the tiny model's logits against transformers at TP 1 (sinks, clamped GLU, biases, windows,
YaRN's attention factor in one forward). Logits at TP x PP x EP run in the multi-process parity launches; the fc2 bias
added once per expert-TP group needs TP 2 there."""

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from tests.adapters.one_process import hf_model, megatron_logits, rows

from toolkit.adapters import mxfp4
from toolkit.adapters.family import AdapterError, WeightMapping
from toolkit.adapters.hf_config import model_settings
from toolkit.adapters.transforms import Kind
from toolkit.models.tiny import tiny_config


def test_config_reads_sinks_clamped_glu_windows_router_and_yarn_scale():
    from toolkit.adapters.families.gpt_oss import SigmoidGate
    from toolkit.adapters.fusions import fusion_fields

    settings = model_settings(tiny_config("gpt_oss"))
    fields = settings.transformer_fields
    assert fields["softmax_type"] == "learnable" and fields["add_bias_linear"] and fields["add_qkv_bias"]
    assert fields["activation_func"] == SigmoidGate(1.702) and fields["activation_func_clamp_value"] == 0.3
    assert fields["glu_linear_offset"] == 1.0 and fields["gated_linear_unit"]
    assert fields["window_size"] == (7, 0) and fields["window_attn_skip_freq"] == [1, 0, 1, 0]
    assert not fields["moe_router_pre_softmax"] and fields["moe_router_topk"] == 2 and fields["num_moe_experts"] == 4
    attention_factor = 0.1 * math.log(4.0) + 1.0  # YaRN factor 4: cos and sin x a, every score x a^2
    assert math.isclose(fields["softmax_scale"], attention_factor**2 / 4.0, rel_tol=1e-12)
    # megatron's fused quick-GEGLU clamps before adding the bias: never fused
    assert not fusion_fields(settings=settings, device="cuda", te_layers=True, fused_rope=True)["bias_activation_fusion"]
    gate = torch.randn(50)
    assert torch.equal(SigmoidGate(1.702)(gate), gate * torch.sigmoid(gate * 1.702))


def test_rope_frequencies_are_transformers_yarn_and_truncate_false_shows():
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    config = tiny_config("gpt_oss")
    inv_freq, attention_factor = _compute_yarn_parameters(config)
    quirks = model_settings(config).quirks
    assert torch.equal(torch.tensor(quirks["rope_inv_freq"]), inv_freq)
    assert quirks["rope_attention_factor"] == attention_factor
    truncated = tiny_config("gpt_oss", rope_parameters={**config.rope_parameters, "truncate": True})
    assert model_settings(truncated).quirks["rope_inv_freq"] != quirks["rope_inv_freq"]  # the tiny ramp is not whole


@pytest.mark.parametrize("fields,named", [
    (dict(attention_bias=False), "attention_bias=False"),
    (dict(attention_dropout=0.1), "attention_dropout=0.1"),
    (dict(num_experts_per_tok=1), "num_experts_per_tok=1"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1000.0}), "rope_type='dynamic'"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor=0.5"),
    (dict(layer_types=["sliding_attention", "chunked_attention"] * 2), "layer_types ['chunked_attention']"),
])
def test_unreproduced_fields_are_refused_by_name(fields, named):
    with pytest.raises(AdapterError, match=named.replace("(", r"\(").replace(".", r"\.").replace("[", r"\[")):
        model_settings(tiny_config("gpt_oss", **fields))


def test_transformer_engine_before_2_8_is_refused_by_name(monkeypatch):
    from megatron.core import utils

    from toolkit.adapters.families import gpt_oss

    monkeypatch.setattr(utils, "is_te_min_version", lambda version: False)
    monkeypatch.setattr(utils, "get_te_version", lambda: "2.4.0")
    with pytest.raises(AdapterError, match=r"Transformer Engine 2\.4\.0.*>= 2\.8\.0.*training\.attention: local"):
        gpt_oss.check_te_sinks()


def test_stacked_expert_rows_read_their_slice_of_the_fused_tensors():
    from toolkit.adapters import transforms
    from toolkit.adapters.load import stacking_problems

    with pytest.raises(ValueError, match="stacked_experts is for an expert's row"):
        WeightMapping("decoder.layers.*.mlp.router.weight", Kind.REPLICATED, ("model.layers.*.mlp.router.weight",),
                      stacked_experts=True)
    items = model_settings(tiny_config("gpt_oss")).load_items()
    fc1 = items["decoder.layers.3.mlp.experts.2.linear_fc1.weight"]
    assert (fc1.hf, fc1.expert_slice, fc1.transposed) == (("model.layers.3.mlp.experts.gate_up_proj",), 2, True)
    assert items["decoder.layers.3.self_attention.core_attention.softmax_offset"].expert_slice is None
    # HF: gate_up = x @ W[e], gate = gate_up[..., ::2], up = gate_up[..., 1::2]; megatron's fc1 rows [gate ; up]
    stacked = torch.randn(4, 64, 96)
    hf_slice = transforms.from_hf_storage(stacked[2], transposed=True)
    fused = transforms.to_megatron(Kind.GATE_UP_INTERLEAVED, [hf_slice], ctx=None)
    assert torch.equal(fused, torch.cat([stacked[2][:, ::2].t(), stacked[2][:, 1::2].t()]))

    class Source:
        def shape(self, name):
            return (3, 64, 96)

    first = items["decoder.layers.0.mlp.experts.0.linear_fc1.weight"]
    assert stacking_problems(first, source=Source(), num_experts=4) == [
        "HF tensor 'model.layers.0.mlp.experts.gate_up_proj' stacks 3 experts on dim 0, the config has 4"]


def hand_built_mxfp4(*, experts=2, rows=6, groups=3):
    """Every FP4 code in both nibbles and exponents from 2^-10 to 2^5 (uint8 scales 117..132)."""
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), generator=generator, dtype=torch.uint8)
    blocks.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    scales = torch.randint(117, 133, (experts, rows, groups), generator=generator).to(torch.uint8)
    return blocks, scales


def test_mxfp4_dequantisation_equals_transformers_bit_for_bit():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = hand_built_mxfp4()
    expected = convert_moe_packed_tensors(blocks, scales)  # [E, G x 32, rows] bf16
    got = mxfp4.dequantize_experts(blocks, scales)
    assert got.dtype == expected.dtype == torch.bfloat16 and torch.equal(got, expected)
    assert mxfp4.parameter_shape(tuple(blocks.shape)) == tuple(expected.shape) == (2, 96, 6)
    for expert in range(2):
        assert torch.equal(mxfp4.dequantize_expert(blocks[expert], scales[expert]), expected[expert])
    # low nibble first: byte 0x21 holds codes 1 (+0.5) then 2 (+1.0), times 2^(scale - 127)
    one = mxfp4.dequantize_rows(torch.full((1, 1, 16), 0x21, dtype=torch.uint8), torch.full((1, 1), 128, dtype=torch.uint8))
    assert one[0, :4].tolist() == [1.0, 2.0, 1.0, 2.0]


def test_mxfp4_pairs_are_checked_and_named():
    u8 = torch.uint8
    entries = {"a.gate_up_proj_blocks": ((2, 6, 3, 16), u8), "a.gate_up_proj_scales": ((2, 6, 3), u8),
               "b.down_proj_blocks": ((2, 6, 3, 16), u8), "c.down_proj_scales": ((2, 6, 3), u8),
               "d.down_proj_blocks": ((2, 6, 3, 16), u8), "d.down_proj_scales": ((2, 6, 4), u8)}
    pairs, problems = mxfp4.pair_mxfp4(entries)
    assert list(pairs) == ["a.gate_up_proj"]
    assert problems == ["MXFP4 blocks b.down_proj_blocks [2, 6, 3, 16] have no b.down_proj_scales",
                        "c.down_proj_scales scales no c.down_proj_blocks",
                        "d.down_proj_blocks [2, 6, 3, 16] torch.uint8 with d.down_proj_scales [2, 6, 4] torch.uint8: "
                        "expected uint8 [experts, rows, G, 16] and uint8 [experts, rows, G]"]


def test_mxfp4_checkpoint_is_refused_unless_dequantised_then_read_as_transformers_parameters(tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from toolkit.adapters.hf_source import QuantizedCheckpointError, SafetensorsSource

    blocks, scales = hand_built_mxfp4()
    name = "model.layers.0.mlp.experts.down_proj"
    save_file({f"{name}_blocks": blocks, f"{name}_scales": scales, "model.norm.weight": torch.ones(4)},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "mxfp4"}}))
    with pytest.raises(QuantizedCheckpointError, match="--dequantize-mxfp4") as refused:
        SafetensorsSource(tmp_path)
    assert refused.value.rule == "mxfp4_checkpoint"
    with pytest.raises(QuantizedCheckpointError, match="'mxfp4'"):
        SafetensorsSource(tmp_path, dequantize_fp8=True)
    source = SafetensorsSource(tmp_path, dequantize_mxfp4=True)
    expected = convert_moe_packed_tensors(blocks, scales)
    assert source.names() == [name, "model.norm.weight"]
    assert (source.shape(name), source.dtype(name), source.nbytes(name)) == ((2, 96, 6), torch.bfloat16, 2 * 96 * 6 * 2)
    assert torch.equal(source.get(name), expected)
    assert torch.equal(source.get_expert(name, expert=1), expected[1])


def test_mxfp4_gpt_oss_converts_with_dequantize_mxfp4_and_exports_transformers_values(tmp_path):
    """A tiny GPT-OSS with its experts stored as MXFP4 (hand-built codes): `dsmt convert hf-to-mcore
    --dequantize-mxfp4` then `mcore-to-hf` gives transformers' dequantised experts, every other tensor as stored."""
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from toolkit.cli import main as dsmt
    from toolkit.models.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "hf", model_type="gpt_oss", seed=3, dtype=torch.bfloat16,
                                intermediate_size=64, num_hidden_layers=1)  # in-features multiples of 32
    tensors, expected = load_file(str(path / "model.safetensors")), {}
    generator = torch.Generator().manual_seed(0)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = tensors.pop(name).shape
        blocks = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), generator=generator, dtype=torch.uint8)
        scales = torch.randint(121, 125, (experts, outputs, inputs // 32), generator=generator).to(torch.uint8)
        tensors |= {f"{name}_blocks": blocks, f"{name}_scales": scales}
        expected[name] = convert_moe_packed_tensors(blocks, scales)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"quantization_config": {"quant_method": "mxfp4"}}))
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert dsmt(["convert", "hf-to-mcore", str(path), str(mcore), "--quiet"]) == 2  # refused by name, see above
    assert dsmt(["convert", "hf-to-mcore", str(path), str(mcore), "--dequantize-mxfp4", "--quiet"]) == 0
    assert dsmt(["convert", "mcore-to-hf", str(mcore), str(back), "--quiet"]) == 0
    exported = load_file(str(back / "model.safetensors"))
    assert sorted(exported) == sorted(set(tensors) - {n for n in tensors if n.endswith(("_blocks", "_scales"))}
                                      | set(expected))
    assert all(torch.equal(exported[n], expected.get(n, tensors.get(n))) for n in exported)
    assert "quantization_config" not in json.loads((back / "config.json").read_text())


def test_tiny_logits_equal_transformers_at_tp1_and_the_clamp_and_sinks_show(tmp_path):
    from toolkit.models.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "gpt_oss", model_type="gpt_oss", seed=21)
    tokens = torch.randint(3, 250, (2, 32), generator=torch.Generator().manual_seed(0))  # past YaRN's 16 and window 8
    logits = megatron_logits(path, batches=[(tokens, rows(tokens), None)])[0][..., :250]
    hf = hf_model(path)  # eager: transformers' only attention for GPT-OSS on CPU (no sdpa with sinks)
    with torch.no_grad():
        reference = hf(tokens).logits
        assert (logits - reference).abs().max().item() < 1e-5
        for layer in hf.model.layers:  # what the comparison sees: the clamp and the sinks move these logits
            layer.mlp.experts.limit = 1e9
        assert (hf(tokens).logits - reference).abs().max().item() > 1e-3
        for layer in hf.model.layers:
            layer.mlp.experts.limit = 0.3
            layer.self_attn.sinks.zero_()
        assert (hf(tokens).logits - reference).abs().max().item() > 1e-3


def test_experts_not_built_as_megatrons_sequential_mlp_are_refused():
    """Grouped-GEMM experts (no mlp.experts.local_experts.*.linear_fc2) would add each expert's fc2 bias once per
    expert-TP rank: the build stops by name instead."""
    from types import SimpleNamespace

    from tests.adapters.one_process import one_process
    from toolkit.adapters.families.gpt_oss import edit_gpt_oss_model

    model = torch.nn.Module()
    model.decoder = torch.nn.ModuleDict({"mlp": torch.nn.ModuleDict({"experts": torch.nn.Linear(2, 2)})})
    model.rotary_pos_emb = SimpleNamespace(inv_freq=torch.zeros(2))
    with one_process(), pytest.raises(AdapterError, match="grouped-GEMM"):
        edit_gpt_oss_model(model, settings=SimpleNamespace(quirks={"rope_inv_freq": (1.0, 0.5)}))
