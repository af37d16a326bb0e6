"""Llama 4 pieces alone (one process): the config it reads (MoE pattern, top-1 sigmoid routing on the experts' input,
interleaved RoPE, NoPE layers, per-layer attention inputs) and the refusals by name; its q / k norm, query
temperature and chunked mask against transformers' own pieces; the stacked expert rows; and the tiny model's logits
against transformers at TP 1 over 32 tokens (4 chunks of 8), with each attention piece shown to matter. Logits at
TP x PP x EP run in the multi-process parity launches."""

import dataclasses

import pytest
import torch

from tests.adapters.one_process import hf_model, megatron_logits, rows

from toolkit.adapters.family import AdapterError
from toolkit.adapters.hf_config import model_settings
from toolkit.adapters.transforms import Kind
from toolkit.models.tiny import make_tiny_checkpoint, tiny_config


def test_config_reads_moe_pattern_sigmoid_top1_on_input_interleaved_rope_and_nope():
    fields = model_settings(tiny_config("llama4_text")).transformer_fields
    assert fields["moe_layer_freq"] == [0, 1, 0, 1]  # interleave_moe_layer_step 2: layers 1 and 3
    assert (fields["moe_ffn_hidden_size"], fields["ffn_hidden_size"]) == (48, 96)
    assert fields["moe_shared_expert_intermediate_size"] == 48 and fields["num_moe_experts"] == 4
    assert fields["moe_router_score_function"] == "sigmoid" and fields["moe_router_topk"] == 1
    assert fields["moe_apply_probs_on_input"] and fields["moe_router_load_balancing_type"] == "none"
    assert fields["rotary_interleaved"] and fields["no_rope_freq"] == [0, 0, 1, 0]
    assert fields["kv_channels"] == 16 and fields["moe_router_dtype"] == "fp32"
    assert not fields["qk_layernorm"]  # the L2 q / k norm is the attention-input hook's, after RoPE


def test_per_layer_attention_inputs_follow_rope_and_layer_types():
    from toolkit.adapters.families.llama4 import Llama4AttentionInputs

    from toolkit.adapters.build import attention_for

    settings = model_settings(tiny_config("llama4_text"))
    hooks = settings.quirks["attention_inputs"]
    assert attention_for(settings=settings, attention=None) == "local"  # verify / convert build megatron's local one
    rope_layer = Llama4AttentionInputs(qk_norm_eps=1e-5, chunk_size=8)
    assert hooks == (rope_layer, rope_layer, Llama4AttentionInputs(temperature=(4.0, 0.5)), rope_layer)
    plain = tiny_config("llama4_text", use_qk_norm=False, attn_temperature_tuning=False, attention_chunk_size=None)
    assert set(model_settings(plain).quirks["attention_inputs"]) == {Llama4AttentionInputs()}


@pytest.mark.parametrize("fields,named", [
    (dict(num_experts_per_tok=2), "num_experts_per_tok=2"),
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(layer_types=["sliding_attention"] * 4), "layer_types="),
    (dict(no_rope_layers=[1, 2, 0, 1]), "no_rope_layers="),
    (dict(moe_layers=[1, 7]), r"moe_layers has \[7\]"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1000.0}), "rope_type 'dynamic'"),
])
def test_unreproduced_fields_are_refused_by_name(fields, named):
    with pytest.raises(AdapterError, match=named):
        model_settings(tiny_config("llama4_text", **fields))


def test_transformer_engine_layers_are_refused_by_name():
    from toolkit.adapters.families.llama4 import edit_llama4_layer_spec

    with pytest.raises(AdapterError, match=r"llama4 with Transformer Engine.*training\.attention: local"):
        edit_llama4_layer_spec(None, config=None, settings=None, transformer_engine=True)


def test_qk_norm_and_temperature_are_transformers_pieces():
    from transformers.models.llama4.modeling_llama4 import Llama4TextWeightlessRMSNorm

    from toolkit.adapters.families.llama4 import query_temperature, weightless_rms_norm

    x = torch.randn(32, 2, 4, 16)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(weightless_rms_norm(x.to(dtype), eps=1e-5), Llama4TextWeightlessRMSNorm(1e-5)(x.to(dtype)))
    positions = torch.arange(32).float()  # HF's Llama4TextAttention, written out
    expected = torch.log1p(torch.floor((positions + 1.0) / 4.0)) * 0.5 + 1.0
    assert torch.equal(query_temperature(positions.long().view(1, 32), 4.0, 0.5).flatten(), expected)


def test_chunked_mask_is_transformers_chunked_causal_mask_per_record():
    """Chunks count from each record's start (as HF fed the record alone): a record packed from column 10 has its
    own chunk boundary at column 18, not the row's at 16."""
    from transformers.masking_utils import chunked_causal_mask_function

    from toolkit.adapters.families.llama4 import chunked_causal_mask, token_positions
    from toolkit.adapters.packed import packed_attention_mask

    allowed = chunked_causal_mask_function(8, torch.zeros(1, dtype=torch.long))

    def masked_alone(length: int) -> torch.Tensor:  # megatron's True = masked, for a record alone
        zero, positions = torch.tensor(0), torch.arange(length)
        return ~allowed(zero, zero, positions.view(length, 1), positions.view(1, length))

    row = torch.arange(20).view(1, 20)
    assert torch.equal(chunked_causal_mask(row, key_positions=row, chunk_size=8, given=None)[0, 0], masked_alone(20))
    packed = packed_attention_mask(torch.cat([torch.arange(10), torch.arange(10)]).view(1, 20))
    positions = token_positions(packed, seq_length=20, device="cpu")
    expected = torch.ones(20, 20, dtype=torch.bool)
    expected[:10, :10], expected[10:, 10:] = masked_alone(10), masked_alone(10)
    assert torch.equal(chunked_causal_mask(positions, key_positions=positions, chunk_size=8, given=packed)[0, 0],
                       expected)


def test_packed_records_chunk_and_scale_as_alone(tmp_path):
    """Records packed in one row, the second starting mid-chunk: each record's logits are those of its forward
    alone (chunks and temperature from the record's own positions)."""
    from tests.adapters.one_process import packed_vs_alone_gap

    path = make_tiny_checkpoint(tmp_path / "llama4_text", model_type="llama4_text", seed=3)
    assert packed_vs_alone_gap(path, lengths=(11, 21)) < 1e-5


def test_stacked_expert_rows_read_gate_then_up_of_the_transposed_slice():
    settings = model_settings(tiny_config("llama4_text"))
    items = settings.load_items()
    fc1 = items["decoder.layers.1.mlp.experts.2.linear_fc1.weight"]
    assert (fc1.kind, fc1.hf, fc1.transposed, fc1.expert_slice) == (
        Kind.GATE_UP_PACKED, ("model.layers.1.feed_forward.experts.gate_up_proj",), True, 2)
    assert items["decoder.layers.3.mlp.experts.0.linear_fc2.weight"].hf == ("model.layers.3.feed_forward.experts.down_proj",)
    assert "decoder.layers.0.mlp.linear_fc1.weight" in items and "decoder.layers.0.mlp.router.weight" not in items
    assert items["decoder.layers.3.mlp.shared_experts.linear_fc2.weight"].hf == (
        "model.layers.3.feed_forward.shared_expert.down_proj.weight",)


def test_tiny_logits_match_transformers_and_each_attention_piece_shows(tmp_path):
    from toolkit.adapters.families import llama4

    path = make_tiny_checkpoint(tmp_path / "llama4", model_type="llama4_text")
    tokens = torch.randint(0, 250, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = hf_model(path)(tokens).logits
    read_quirks = llama4.read_llama4_quirks

    def without(part):
        def quirks(hf_config):
            hooks = read_quirks(hf_config)["attention_inputs"]
            return {"local_attention": True,
                    "attention_inputs": tuple(dataclasses.replace(hook, **{part: None}) for hook in hooks)}
        return quirks

    gaps = {}
    try:
        for part in (None, "qk_norm_eps", "temperature", "chunk_size"):
            # the registered family is frozen: its hook swapped in place, and restored below
            object.__setattr__(llama4.LLAMA4_TEXT, "read_quirks", read_quirks if part is None else without(part))
            logits, = megatron_logits(path, batches=[(tokens, rows(tokens), None)])
            gaps[part] = (logits[..., :250] - reference).abs().max().item()
    finally:
        object.__setattr__(llama4.LLAMA4_TEXT, "read_quirks", read_quirks)
    assert gaps[None] <= 1e-5, gaps  # observed 2.4e-7
    assert min(gaps[part] for part in ("qk_norm_eps", "temperature", "chunk_size")) > 1e-3, gaps
