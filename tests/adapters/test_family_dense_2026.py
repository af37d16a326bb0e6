"""Seed-OSS, SmolLM3 and ERNIE 4.5 (dense) alone, one process: config reading, each refusal by name, ERNIE's
interleaved RoPE against transformers' own (fp32 and bf16), the fusions and layout rules they get. Logits at
TP x PP are for test_parity_multiproc.py, round trips for test_convert.py."""

import types

import pytest
import torch

from toolkit.adapters.family import AdapterError
from toolkit.adapters.hf_config import model_settings
from toolkit.models.tiny import tiny_config


def fields_of(model_type: str, **overrides) -> dict:
    return model_settings(tiny_config(model_type, **overrides)).transformer_fields


def hf_names(model_type: str, **overrides) -> set[str]:
    return {name for row in model_settings(tiny_config(model_type, **overrides)).weight_table() for name in row.hf}


def test_seed_oss_reads_qkv_biases_head_dim_and_dropouts():
    fields = fields_of("seed_oss", attention_dropout=0.1, residual_dropout=0.05)
    assert fields["kv_channels"] == 16 and fields["add_qkv_bias"] and not fields["add_bias_linear"]
    assert (fields["attention_dropout"], fields["hidden_dropout"]) == (0.1, 0.05)
    assert "model.layers.*.self_attn.q_proj.bias" in hf_names("seed_oss")
    assert not fields_of("seed_oss", attention_bias=False)["add_qkv_bias"]
    assert "model.layers.*.self_attn.q_proj.bias" not in hf_names("seed_oss", attention_bias=False)
    assert not model_settings(tiny_config("seed_oss")).tied_embeddings  # untied as released


def test_seed_oss_has_no_embedding_dropout():
    from toolkit.adapters.families.seed_oss import edit_seed_oss_model

    first = types.SimpleNamespace(pre_process=True, embedding=types.SimpleNamespace(
        embedding_dropout=torch.nn.Dropout(0.1)))
    edit_seed_oss_model(first, settings=None)
    assert first.embedding.embedding_dropout.p == 0.0
    edit_seed_oss_model(types.SimpleNamespace(pre_process=False), settings=None)  # later stages: no embedding


def test_smollm3_no_rope_layers_become_megatron_no_rope_freq():
    assert fields_of("smollm3")["no_rope_freq"] == [0, 1, 1, 0]  # tiny: no_rope_layers [1, 0, 0, 1]
    # transformers' default: every 4th layer NoPE; a list longer than the model is cut to it
    assert fields_of("smollm3", no_rope_layers=None, num_hidden_layers=8)["no_rope_freq"] == [0, 0, 0, 1] * 2
    assert fields_of("smollm3", no_rope_layers=[1, 1, 1, 0, 1], num_hidden_layers=4)["no_rope_freq"] == [0, 0, 0, 1]
    assert fields_of("smollm3", no_rope_layers=[1, 1, 1, 1])["no_rope_freq"] is None
    assert model_settings(tiny_config("smollm3")).tied_embeddings


def test_smollm3_window_is_on_its_sliding_layers_only():
    fields = fields_of("smollm3", use_sliding_window=True, sliding_window=8)  # transformers: the NoPE layers
    assert fields["window_size"] == (7, 0) and fields["window_attn_skip_freq"] == [0, 1, 1, 0]
    assert "window_size" not in fields_of("smollm3", sliding_window=8)  # use_sliding_window false


def test_ernie4_5_reads_interleaved_rope_and_linear_biases():
    fields = fields_of("ernie4_5")
    assert fields["rotary_interleaved"] and fields["kv_channels"] == 16
    assert not (fields["add_bias_linear"] or fields["add_qkv_bias"])
    biased = fields_of("ernie4_5", use_bias=True)
    assert biased["add_bias_linear"] and biased["add_qkv_bias"]
    names = hf_names("ernie4_5", use_bias=True)
    assert {"model.layers.*.self_attn.o_proj.bias", "model.layers.*.mlp.gate_proj.bias",
            "model.layers.*.mlp.down_proj.bias"} <= names
    assert not any(name.endswith(".bias") for name in hf_names("ernie4_5"))
    assert model_settings(tiny_config("ernie4_5")).tied_embeddings


@pytest.mark.parametrize("model_type,fields,named", [
    ("seed_oss", dict(attention_out_bias=True), "attention_out_bias=True"),
    ("seed_oss", dict(mlp_bias=True), "mlp_bias=True"),
    ("seed_oss", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}), "'dynamic'"),
    ("smollm3", dict(attention_bias=True), "attention_bias=True"),
    ("smollm3", dict(mlp_bias=True), "mlp_bias=True"),
    ("smollm3", dict(no_rope_layers=[1, 2, 1, 0]), "no_rope_layers=[1, 2, 1, 0]"),
    ("smollm3", dict(sliding_window=8, layer_types=["full_attention", "sliding_attention"] * 2),
     "layer_types has 'sliding_attention' layers while use_sliding_window=False"),
    ("ernie4_5", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}), "'dynamic'"),
])
def test_unreproduced_fields_are_refused_by_name(model_type, fields, named):
    with pytest.raises(AdapterError, match=named.replace("(", r"\(").replace("[", r"\[")):
        model_settings(tiny_config(model_type, **fields))


def _rotate(q_bshd, *, fp32: bool):
    """megatron's unfused interleaved RoPE (optionally on fp32 queries, as Fp32RopeSelfAttention gives it),
    on HF's [b, heads, s, d] layout."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from toolkit.backend import cpu

    cpu.install()
    seq_len, head_dim = q_bshd.shape[2], q_bshd.shape[3]
    freqs = RotaryEmbedding(kv_channels=head_dim, rotary_percent=1.0, rotary_interleaved=True,
                            rotary_base=10000.0, use_cpu_initialization=True)(seq_len)
    sbhd = q_bshd.permute(2, 0, 1, 3)
    rotated = _apply_rotary_pos_emb_bshd(sbhd.float() if fp32 else sbhd, freqs, rotary_interleaved=True)
    return rotated.to(q_bshd.dtype).permute(1, 2, 0, 3)


def test_ernie4_5_rope_is_megatrons_interleaved_and_rounds_once_in_bf16():
    from transformers.models.ernie4_5.modeling_ernie4_5 import Ernie4_5RotaryEmbedding, apply_rotary_pos_emb

    config = tiny_config("ernie4_5")
    torch.manual_seed(0)
    q = 3 * torch.randn(2, 4, 32, config.head_dim)
    cos, sin = Ernie4_5RotaryEmbedding(config)(q, torch.arange(32)[None])
    hf, _ = apply_rotary_pos_emb(q, q, cos, sin)
    assert torch.equal(_rotate(q, fp32=False), hf)
    hf_bf16, _ = apply_rotary_pos_emb(q.bfloat16(), q.bfloat16(), cos, sin)  # HF rotates in fp32, rounds once
    assert torch.equal(_rotate(q.bfloat16(), fp32=True), hf_bf16)
    assert not torch.equal(_rotate(q.bfloat16(), fp32=False), hf_bf16)  # megatron's own bf16 rotation rounds more


def test_ernie4_5_attention_rotates_fp32_and_attends_in_the_model_dtype():
    """The built layer (TP1, bf16): megatron's RoPE sees fp32 queries / keys, the core attention gets them back in
    bf16, and they are transformers' rotation of the same projections, bit for bit."""
    from megatron.core import parallel_state
    from transformers.models.ernie4_5.modeling_ernie4_5 import Ernie4_5RotaryEmbedding, apply_rotary_pos_emb

    from toolkit import backend as backends
    from toolkit.adapters.build import build_model_chunks
    from toolkit.launch.local import single_process_group
    from toolkit.parallel.groups import Layout

    config = tiny_config("ernie4_5", num_hidden_layers=1)
    seen = {}
    with single_process_group(dist_backend="gloo"):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        backends.current().seed(0)
        (chunk,) = build_model_chunks(settings=model_settings(config), layout=Layout(), params_dtype=torch.bfloat16,
                                      init_weights=True)
        attention = chunk.decoder.layers[0].self_attention
        assert type(attention).__name__ == "Fp32RopeSelfAttention"
        projections = attention.get_query_key_value_tensors
        attention.get_query_key_value_tensors = lambda *a, **k: seen.setdefault("unrotated", projections(*a, **k))
        attention.core_attention.register_forward_pre_hook(lambda module, args: seen.setdefault("rotated", args))
        with torch.no_grad():
            chunk(torch.randint(0, 250, (2, 12)), torch.arange(12)[None].expand(2, 12), None)
    unrotated, rotated = seen["unrotated"], seen["rotated"]
    assert unrotated[0].dtype == torch.float32 and rotated[0].dtype == rotated[1].dtype == torch.bfloat16
    cos, sin = Ernie4_5RotaryEmbedding(config)(rotated[0], torch.arange(12)[None])
    for before, after in zip(unrotated[:2], rotated[:2]):  # megatron [s, b, heads, d] -> HF [b, heads, s, d]
        hf, _ = apply_rotary_pos_emb(*(before.bfloat16().permute(1, 2, 0, 3),) * 2, cos, sin)
        assert torch.equal(after.permute(1, 2, 0, 3), hf)


@pytest.mark.parametrize("model_type, rope_fused", [("seed_oss", True), ("smollm3", True), ("ernie4_5", False)])
def test_ernie4_5_keeps_the_unfused_rope_on_transformer_engine(model_type, rope_fused):
    from toolkit.adapters import fusions

    fields = fusions.fusion_fields(settings=model_settings(tiny_config(model_type)), device="cuda", te_layers=True,
                                   fused_rope=True)
    assert fields["apply_rope_fusion"] is rope_fused and fields["bias_activation_fusion"]


@pytest.mark.parametrize("model_type", ["seed_oss", "smollm3", "ernie4_5"])
def test_layout_rules_hold_for_the_new_families(model_type):
    from toolkit.adapters.model_shape import model_facts
    from toolkit.parallel.layout import Layout
    from toolkit.parallel.rules import layout_problems

    facts = model_facts(tiny_config(model_type), vocab_pad_multiple=128)  # 8 heads, 2 KV heads, 4 layers
    assert not layout_problems(layout=Layout(tp=2, pp=2, dp=1), model=facts)
    assert not layout_problems(layout=Layout(tp=4, pp=1, dp=1), model=facts)  # each KV head on 2 ranks
    assert "heads_vs_tp" in {p.rule for p in layout_problems(layout=Layout(tp=3, pp=1, dp=1), model=facts)}
    assert layout_problems(layout=Layout(tp=1, pp=3, dp=1), model=facts)  # 4 layers on 3 stages
