"""Mixture-of-experts families (Mixtral, Qwen3-MoE): their tables against saved checkpoints, the routing and
load-balancing settings read from HF configs, and what is refused."""

import pytest
from safetensors import safe_open

from toolkit.adapters.family import AdapterError, WeightMapping, get_family
from toolkit.adapters.hf_config import model_settings
from toolkit.adapters.load import check_hf_coverage
from toolkit.adapters.transforms import Kind
from toolkit.models.tiny import make_tiny_checkpoint, tiny_config


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_table_covers_every_tensor_of_a_saved_checkpoint(model_type, tmp_path):
    """save_pretrained writes one tensor per expert (transformers fuses them only in memory)."""
    path = make_tiny_checkpoint(tmp_path / model_type, model_type=model_type, num_hidden_layers=2)
    with safe_open(path / "model.safetensors", "pt") as f:
        names = list(f.keys())
    settings = model_settings(tiny_config(model_type, num_hidden_layers=2))
    items = settings.load_items()
    assert check_hf_coverage(items=items, hf_names=names, ignored=settings.ignored_hf()) == []
    experts = [name for name in items if ".mlp.experts." in name]
    assert len(experts) == 2 * 4 * 2  # layers x experts x (fc1, fc2)
    assert items["decoder.layers.1.mlp.experts.3.linear_fc1.weight"].kind is Kind.GATE_UP


def test_expert_rows_expand_layer_then_expert():
    row = get_family("mixtral").weights[-2]
    assert row.per_expert and row.for_layer(5, 2) == (
        "decoder.layers.5.mlp.experts.2.linear_fc1.weight",
        ("model.layers.5.block_sparse_moe.experts.2.w1.weight", "model.layers.5.block_sparse_moe.experts.2.w3.weight"))
    with pytest.raises(ValueError, match="the same `\\*`s"):
        WeightMapping("decoder.layers.*.mlp.experts.*.linear_fc2.weight", Kind.ROW, ("model.layers.*.w2.weight",))


def test_routing_and_load_balancing_settings():
    mixtral = model_settings(tiny_config("mixtral")).transformer_fields
    assert (mixtral["num_moe_experts"], mixtral["moe_router_topk"], mixtral["moe_ffn_hidden_size"]) == (4, 2, 96)
    assert mixtral["moe_router_pre_softmax"] is False  # softmax over the top-k logits = renormalised top-k
    assert mixtral["moe_router_load_balancing_type"] == "none"  # HF adds no aux loss without output_router_logits
    qwen = model_settings(tiny_config("qwen3_moe")).transformer_fields
    assert qwen["moe_router_pre_softmax"] is True and qwen["ffn_hidden_size"] == qwen["moe_ffn_hidden_size"] == 48
    assert model_settings(tiny_config("qwen3_moe", norm_topk_prob=True)).transformer_fields["moe_router_pre_softmax"] \
        is False
    aux = model_settings(tiny_config("mixtral", output_router_logits=True, router_aux_loss_coef=0.02)).transformer_fields
    # HF's coefficient times k / layers: megatron's per-layer sum is then the mean of HF's per-layer terms
    assert aux["moe_router_load_balancing_type"] == "aux_loss" and aux["moe_aux_loss_coeff"] == pytest.approx(0.02 * 2 / 4)


@pytest.mark.parametrize("model_type,overrides,message", [
    ("mixtral", dict(num_experts_per_tok=1), "num_experts_per_tok=1 with renormalised top-k"),
    ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise=0.1"),
    ("qwen3_moe", dict(mlp_only_layers=[1]), "mlp_only_layers=[1]"),
    ("qwen3_moe", dict(decoder_sparse_step=2), "decoder_sparse_step=2"),
])
def test_configs_megatron_cannot_reproduce_are_refused(model_type, overrides, message):
    with pytest.raises(AdapterError, match=message.replace("[", "\\[").replace("]", "\\]")):
        model_settings(tiny_config(model_type, **overrides))


def test_top1_without_renormalisation_is_supported():
    fields = model_settings(tiny_config("qwen3_moe", num_experts_per_tok=1)).transformer_fields
    assert fields["moe_router_topk"] == 1 and fields["moe_router_pre_softmax"] is True


def _fails(argv, capsys, *fragments) -> None:
    from toolkit.cli import main as dsmt

    assert dsmt(argv) == 2
    captured = capsys.readouterr()
    output = captured.out + captured.err  # `dsmt check` prints its report, the other commands an error
    assert all(fragment in output for fragment in fragments), output


def test_verify_refuses_ep_that_does_not_fit_before_any_process_starts(tmp_path, capsys):
    mixtral = make_tiny_checkpoint(tmp_path / "mixtral", model_type="mixtral", num_hidden_layers=2)
    llama = make_tiny_checkpoint(tmp_path / "llama", num_hidden_layers=2)
    _fails(["verify", str(mixtral), "--ep", "3"], capsys, "[experts_vs_ep] ep=3 does not divide num_experts=4")
    _fails(["verify", str(llama), "--ep", "2"], capsys, "[ep_needs_experts] ep=2 with a dense model")


def test_check_names_every_expert_parallel_problem(tmp_path, capsys):
    import yaml

    config = {**tiny_config("mixtral").to_dict(), "model_type": "mixtral"}
    spec = {"model": {"config": config},
            "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu": "cpu", "device": "cpu", "interconnect": "tcp"},
            "parallel": {"tp": 1, "ep": 4, "zero_stage": 3},
            "training": {"global_batch_size": 4, "micro_batch_size": 1, "seq_length": 32, "precision": "fp32",
                         "attention": "local", "train_steps": 2, "warmup_steps": 0},
            "data": {"synthetic": True}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    _fails(["check", str(path)], capsys, "ep_vs_data_parallel", "ep=4 does not divide dp×cp=2×1=2", "zero3_with_ep")


def test_load_balancing_scale_lives_on_the_losss_device(monkeypatch):
    """PP = 1 sets megatron's load-balancing gradient scale itself; megatron multiplies it with the aux loss in
    backward, so on a GPU it must be a CUDA tensor (a 1-element CPU tensor does not mix). `meta` stands in for the
    GPU: a scale left on the CPU shows as one."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from toolkit.train.engine.moe import set_aux_loss_scale

    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: 2)
    monkeypatch.setattr(MoEAuxLossAutoScaler, "main_loss_backward_scale", None)
    set_aux_loss_scale(4, device=torch.device("meta"))
    scale = MoEAuxLossAutoScaler.main_loss_backward_scale
    assert scale.device.type == "meta" and scale.shape == (1,)
    monkeypatch.setattr(MoEAuxLossAutoScaler, "main_loss_backward_scale", None)
    set_aux_loss_scale(4, device="cpu")
    assert MoEAuxLossAutoScaler.main_loss_backward_scale.tolist() == [0.5]  # cp / micro-batches
