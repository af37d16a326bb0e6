"""Granite, OLMo-2 and StarCoder2 pieces alone (one process): their config reading and refusals, OLMo-2's norms
against HF's Olmo2RMSNorm, and Granite's scaled bias-dropout-add and hooks. Logits at TP x PP are in
test_parity_multiproc.py, round trips in test_convert.py, training and LoRA in tests/train."""

import pytest
import torch

from toolkit.adapters.family import AdapterError
from toolkit.adapters.hf_config import model_settings
from toolkit.models.tiny import tiny_config


def test_granite_reads_its_four_scalars():
    settings = model_settings(tiny_config("granite"))
    assert settings.transformer_fields["softmax_scale"] == 0.2
    multipliers = settings.multipliers
    assert (multipliers.embedding, multipliers.residual, multipliers.logits_divisor) == (3.0, 0.6, 2.5)
    assert model_settings(tiny_config("llama")).multipliers.residual == 1.0


def test_starcoder2_reads_norm_window_and_dropout():
    fields = model_settings(tiny_config("starcoder2", residual_dropout=0.1, embedding_dropout=0.1)).transformer_fields
    assert fields["window_size"] == (7, 0) and fields["window_attn_skip_freq"] == [1, 1, 1, 1]
    assert fields["layernorm_epsilon"] == 1e-5 and fields["hidden_dropout"] == 0.1
    assert fields["add_bias_linear"] and not fields["gated_linear_unit"] and fields["normalization"] == "LayerNorm"


@pytest.mark.parametrize("model_type,fields,named", [
    ("starcoder2", dict(use_bias=False), "use_bias=False"),
    ("starcoder2", dict(embedding_dropout=0.1), "embedding_dropout=0.1 != residual_dropout=0.0"),
    ("granite", dict(mlp_bias=True), "mlp_bias=True"),
    ("granite", dict(attention_bias=True), "attention_bias=True"),
    ("olmo2", dict(attention_bias=True), "attention_bias=True"),
    ("olmo2", dict(attention_dropout=0.1), "attention_dropout=0.1"),
])
def test_unreproduced_fields_are_refused_by_name(model_type, fields, named):
    with pytest.raises(AdapterError, match=named.replace("(", r"\(").replace(".", r"\.")):
        model_settings(tiny_config(model_type, **fields))


class _Config:
    """The TransformerConfig fields the OLMo-2 norms read."""

    def __init__(self, **fields):
        self.params_dtype, self.sequence_parallel, self.tensor_model_parallel_size = torch.float32, False, 1
        self.layernorm_epsilon, self.hidden_size, self.layernorm_zero_centered_gamma = 1e-6, 12, False
        self.__dict__.update(fields)


def test_olmo2_projection_norm_equals_hf_norm_over_the_whole_projection():
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    from toolkit.adapters.families.olmo2 import KeyProjectionRMSNorm, ProjectionRMSNorm

    torch.manual_seed(0)
    config = _Config(num_attention_heads=4, num_query_groups=2)
    for norm_class, heads in ((ProjectionRMSNorm, 4), (KeyProjectionRMSNorm, 2)):
        ours, hf = norm_class(config, hidden_size=8, eps=1e-6), Olmo2RMSNorm(heads * 8, eps=1e-6)
        with torch.no_grad():
            ours.weight.copy_(torch.randn(heads * 8))
            hf.weight.copy_(ours.weight)
        x = 3 * torch.randn(5, 2, heads, 8)  # megatron's [s, b, heads, head_dim]
        expected = hf(x.reshape(5, 2, heads * 8)).reshape(x.shape)
        torch.testing.assert_close(ours(x), expected, rtol=0, atol=1e-6)
        per_head = Olmo2RMSNorm(8, eps=1e-6)(x)  # Qwen3's per-head norm is something else
        assert (per_head - expected).abs().max() > 1e-2


def test_olmo2_post_norm_is_applied_before_the_residual_add():
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    from toolkit.adapters.families.olmo2 import NormThenAdd

    torch.manual_seed(1)
    bda = NormThenAdd(config=_Config())
    hf = Olmo2RMSNorm(12, eps=1e-6)
    with torch.no_grad():
        bda.norm.weight.copy_(torch.randn(12))
        hf.weight.copy_(bda.norm.weight)
    output, residual = torch.randn(3, 2, 12), torch.randn(3, 2, 12)
    got = bda(False, False)((output, None), residual, 0.0)
    torch.testing.assert_close(got, residual + hf(output), rtol=0, atol=1e-6)


def test_granite_residual_multiplier_scales_output_and_bias_before_the_add():
    from megatron.core.models.gpt import gpt_layer_specs

    from toolkit.adapters.build import scaled_bias_dropout_add, with_residual_multiplier

    output, bias, residual = torch.randn(3, 2, 4), torch.randn(4), torch.randn(3, 2, 4)
    got = scaled_bias_dropout_add(0.6)(False, False)((output, bias), residual, 0.0)
    torch.testing.assert_close(got, residual + (output + bias) * 0.6)
    spec = gpt_layer_specs.get_gpt_layer_local_spec()
    assert with_residual_multiplier(spec, multiplier=1.0) is spec
    scaled = with_residual_multiplier(spec, multiplier=0.6).submodules
    assert scaled.self_attn_bda is scaled.mlp_bda and scaled.self_attn_bda is not spec.submodules.self_attn_bda


def test_granite_embedding_and_logits_hooks():
    from toolkit.adapters.build import EmbeddingMultiplier, LogitsDivisor

    x = torch.randn(2, 3)
    torch.testing.assert_close(EmbeddingMultiplier(3.0)(None, (), x), x * 3.0)
    logits, bias = LogitsDivisor(2.5)(None, (), (x, None))
    assert torch.equal(logits, x / 2.5) and bias is None


def test_olmo2_tp_that_would_replicate_kv_heads_is_refused_before_ranks_start():
    from toolkit.adapters.model_shape import model_facts
    from toolkit.parallel.layout import Layout
    from toolkit.parallel.rules import layout_problems

    olmo2, llama = (model_facts(tiny_config(t, num_key_value_heads=2), vocab_pad_multiple=128)
                    for t in ("olmo2", "llama"))
    layout = Layout(tp=4, pp=1, dp=1)
    problems = layout_problems(layout=layout, model=olmo2)
    assert [p.rule for p in problems] == ["kv_heads_vs_tp"] and "q / k norms span all heads" in problems[0].message
    assert not layout_problems(layout=layout, model=llama)  # Llama replicates each KV head on 2 ranks
    assert not layout_problems(layout=Layout(tp=2, pp=1, dp=1), model=olmo2)


def test_softcap_is_hf_eager_order_and_changes_values():
    from toolkit.adapters.softcap import LogitsSoftcap, softcap

    scores = 4 * torch.randn(2, 3, 5, 5)
    expected = torch.tanh(scores / 0.5) * 0.5  # transformers' eager_attention_forward, Gemma2ForCausalLM
    assert torch.equal(softcap(scores, cap=0.5), expected) and (expected - scores).abs().max() > 1.0
    logits, bias = LogitsSoftcap(3.0)(None, (), (scores, None))
    assert torch.equal(logits, torch.tanh(scores / 3.0) * 3.0) and bias is None


def test_gemma2_softcapped_attention_is_local_and_refused_on_transformer_engine():
    from megatron.core.models.gpt import gpt_layer_specs

    from toolkit.adapters.build import is_local_spec, local_layer_spec
    from toolkit.adapters.softcap import with_attention_softcap

    spec = local_layer_spec()
    capped = with_attention_softcap(spec, cap=50.0, transformer_engine=False)
    core = capped.submodules.self_attention.submodules.core_attention
    assert core.params == {"attention_softcap": 50.0} and is_local_spec(capped)
    assert with_attention_softcap(spec, cap=None, transformer_engine=False) is spec
    with pytest.raises(AdapterError, match=r"attn_logit_softcapping=50.0: Transformer Engine.*training.attention: local"):
        with_attention_softcap(gpt_layer_specs.get_gpt_layer_local_spec(), cap=50.0, transformer_engine=True)


def test_gemma2_and_gemma3_read_their_scale_softcaps_windows_and_ropes():
    gemma2 = model_settings(tiny_config("gemma2"))
    fields = gemma2.transformer_fields
    assert fields["softmax_scale"] == 24 ** -0.5 and fields["window_attn_skip_freq"] == [1, 0, 1, 0]
    assert fields["window_size"] == (7, 0) and fields["layernorm_zero_centered_gamma"]
    assert gemma2.quirks == {"attn_logit_softcapping": 0.5, "final_logit_softcapping": 3.0}
    gemma3 = model_settings(tiny_config("gemma3_text"))
    assert gemma3.rotary_base == 1e6 and gemma3.rope_scaling == {"linear_factor": 4.0}
    assert gemma3.quirks["local_rope_theta"] == 100.0 and gemma3.quirks["local_rope_layers"] == (True, False) * 2
    assert gemma3.attention_softcap is None and gemma3.transformer_fields["qk_layernorm"]


@pytest.mark.parametrize("model_type,fields,named", [
    ("gemma2", dict(use_bidirectional_attention=True), "use_bidirectional_attention=True"),
    ("gemma2", dict(attention_bias=True), "attention_bias=True"),
    ("gemma2", dict(hidden_activation="silu"), "hidden_activation='silu'"),
    ("gemma3_text", dict(rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0,
                                                                "rope_theta": 1e4},
                                          "full_attention": {"rope_type": "default", "rope_theta": 1e6}}),
     "rope_parameters.sliding_attention.rope_type='linear'"),
    ("gemma3_text", dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                          "full_attention": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6}}),
     "rope_type 'yarn' is not supported"),
])
def test_gemma_fields_not_reproduced_are_refused_by_name(model_type, fields, named):
    with pytest.raises(AdapterError, match=named.replace("(", r"\(").replace(".", r"\.")):
        model_settings(tiny_config(model_type, **fields))


def test_dual_rotary_gives_each_layer_kind_its_own_table():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from toolkit.adapters.families.gemma3 import DualRotary
    from toolkit.backend import cpu

    cpu.install()  # megatron's rotary moves its frequencies to CUDA unless the CPU backend is in
    rotaries = [RotaryEmbedding(kv_channels=8, rotary_percent=1.0, rotary_base=base, use_cpu_initialization=True)
                for base in (1e6, 100.0)]
    table = DualRotary(global_rotary=rotaries[0], local_rotary=rotaries[1])(6)
    global_table, local_table = table.chunk(2, dim=-1)
    assert torch.equal(global_table, rotaries[0](6)) and torch.equal(local_table, rotaries[1](6))
    assert not torch.equal(global_table, local_table)


def test_linear_rope_scaling_divides_the_inverse_frequencies_as_hf_does():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from toolkit.adapters.hf_config import rope_settings

    config = tiny_config("llama", rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})
    assert rope_settings(config) == (10000.0, {"linear_factor": 4.0}, None)
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["linear"](config, "cpu")
    megatron = 1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    assert torch.equal(megatron / 4.0, hf_inv_freq)


def test_check_and_dry_run_refuse_softcapped_attention_on_transformer_engine(tmp_path):
    from toolkit.check.checks import run_checks
    from toolkit.spec.load import validate_spec
    from toolkit.models.tiny import make_tiny_checkpoint
    from toolkit.check.dryrun import dry_run

    checkpoint = make_tiny_checkpoint(tmp_path / "gemma2", model_type="gemma2")
    raw = {"model": {"path": str(checkpoint)},
           "cluster": {"gpus_per_node": 2, "gpu": "a100-80gb", "device": "cuda"},
           "training": {"global_batch_size": 4, "micro_batch_size": 2, "seq_length": 32, "precision": "bf16",
                        "train_steps": 2, "warmup_steps": 1, "attention": "fused", "output_dir": str(tmp_path / "out")},
           "data": {"synthetic": True}}
    report = run_checks(spec=validate_spec(raw, source="gemma2"))
    (problem,) = [p for p in report.problems if p.rule == "attention_softcap_needs_local"]
    assert "attn_logit_softcapping=0.5 with training.attention=fused" in problem.message
    assert "training.attention: local" in problem.fix
    raw["training"]["attention"] = "local"
    assert "attention_softcap_needs_local" not in run_checks(spec=validate_spec(raw, source="gemma2")).rules("error")
    raw["training"]["attention"] = "fused"
    spec_path = tmp_path / "job.yaml"
    spec_path.write_text(__import__("yaml").safe_dump(raw))
    found = [p for p in dry_run(spec_path).problems if "attention_softcap_needs_local" in p.rule + p.message]
    assert len(found) == 1  # said once, by the check the dry run includes


def test_plan_of_a_softcapped_model_counts_the_local_attention_it_will_run(tmp_path, capsys):
    from toolkit.cli import main as dsmt

    config = tiny_config("gemma2", hidden_size=1024, num_hidden_layers=8, intermediate_size=4096, vocab_size=32000)
    config.save_pretrained(tmp_path)
    argv = ["plan", str(tmp_path), "--nodes", "1", "--gpus-per-node", "8", "--seq-len", "4096", "--global-batch", "64",
            "--json"]
    assert dsmt(argv) == 0
    planned = capsys.readouterr()
    assert "attn_logit_softcapping=0.5: Transformer Engine's attention has no softcap" in planned.err
    assert dsmt(argv + ["--attention", "local"]) == 0
    local = capsys.readouterr().out
    assert planned.out == local
    config.attn_logit_softcapping = None
    config.save_pretrained(tmp_path)
    assert dsmt(argv) == 0
    assert capsys.readouterr().out != local  # fused attention stores no s x s scores: another plan


def test_check_names_a_config_field_the_family_cannot_reproduce(tmp_path):
    from toolkit.check.checks import run_checks
    from toolkit.spec.load import validate_spec

    tiny_config("gemma2", use_bidirectional_attention=True).save_pretrained(tmp_path / "gemma2")
    raw = {"model": {"path": str(tmp_path / "gemma2")},
           "cluster": {"gpus_per_node": 2, "gpu": "cpu", "device": "cpu", "interconnect": "tcp"},
           "training": {"global_batch_size": 4, "micro_batch_size": 2, "seq_length": 32, "precision": "fp32",
                        "train_steps": 2, "warmup_steps": 1, "output_dir": str(tmp_path / "out")},
           "data": {"synthetic": True}}
    report = run_checks(spec=validate_spec(raw, source="gemma2"))
    (problem,) = [p for p in report.problems if p.rule == "model_config"]
    assert "use_bidirectional_attention=True" in problem.message and not report.ok


def test_gemma3_layer_table_is_its_half_and_contiguous_for_fused_rope():
    from toolkit.adapters.families.gemma3 import layer_table

    tables = torch.randn(6, 1, 1, 16)
    for local, half in ((False, tables[..., :8]), (True, tables[..., 8:])):
        table = layer_table(tables, local=local)
        # TE's fused RoPE reads freqs as a dense [s, 1, 1, d] array: a strided view would feed it wrong rows
        assert torch.equal(table, half) and table.is_contiguous()


def test_zero_centred_norm_in_bf16_is_hf_gemma_norm_to_the_bit():
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    from toolkit.adapters.norms import ZeroCenteredRMSNorm

    torch.manual_seed(2)
    ours, hf = ZeroCenteredRMSNorm(64, eps=1e-6).to(torch.bfloat16), Gemma2RMSNorm(64, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        ours.weight.copy_(0.3 * torch.randn(64))
        hf.weight.copy_(ours.weight)
    x = (3 * torch.randn(4, 7, 64)).to(torch.bfloat16)
    assert torch.equal(ours(x), hf(x))


def test_verify_builds_softcapped_models_on_local_attention_even_where_te_is():
    from toolkit.adapters.build import attention_for

    gemma2, llama = model_settings(tiny_config("gemma2")), model_settings(tiny_config("llama"))
    assert attention_for(settings=gemma2, attention=None) == "local"  # TE's layers would refuse the softcap
    assert attention_for(settings=llama, attention=None) is None  # the machine decides (TE where installed)
    assert attention_for(settings=gemma2, attention="fused") == "fused"  # a run's own choice: the rule refuses it


def test_gemma_configs_dsmt_cannot_read_as_hf_does_are_refused():
    config = tiny_config("gemma2")
    config.layer_types = None  # what transformers < 4.53 leaves
    with pytest.raises(AdapterError, match="without layer_types"):
        model_settings(config)
    with pytest.raises(AdapterError, match=r"attn_logit_softcapping=50\.0: transformers' Gemma 3 attention ignores"):
        model_settings(tiny_config("gemma3_text", attn_logit_softcapping=50.0))


def test_check_applies_the_family_layout_rules_from_the_shape(tmp_path):
    from toolkit.adapters.model_shape import load_model_shape

    tiny_config("olmo2", num_key_value_heads=2).save_pretrained(tmp_path / "olmo2")
    tiny_config("llama", num_key_value_heads=2).save_pretrained(tmp_path / "llama")
    assert not load_model_shape(tmp_path / "olmo2").kv_heads_replicable
    assert load_model_shape(tmp_path / "llama").kv_heads_replicable
    from toolkit.check.checks import run_checks
    from toolkit.spec.load import validate_spec

    raw = {"model": {"path": str(tmp_path / "olmo2")}, "parallel": {"tp": 4},
           "cluster": {"gpus_per_node": 4, "gpu": "cpu", "device": "cpu", "interconnect": "tcp"},
           "training": {"global_batch_size": 4, "micro_batch_size": 4, "seq_length": 32, "precision": "fp32",
                        "train_steps": 2, "warmup_steps": 1, "output_dir": str(tmp_path / "out")},
           "data": {"synthetic": True}}
    errors = [p for p in run_checks(spec=validate_spec(raw, source="olmo2")).problems if p.rule == "kv_heads_vs_tp"]
    assert len(errors) == 1 and "q / k norms span all heads" in errors[0].message
