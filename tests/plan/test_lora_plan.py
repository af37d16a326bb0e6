"""LoRA in the planner (toolkit/plan/lora.py): adapter counts against PEFT's published figure, and model states
that hold gradients and optimizer state for the adapters only."""

from __future__ import annotations

import dataclasses

import pytest

from toolkit.plan.assumptions import Assumptions
from toolkit.plan.layout import PlanLayout, TrainingShape
from toolkit.plan.lora import LoraShape, lora_params, stage_lora_params
from toolkit.plan.memory import model_state_bytes, persistent_params, stage_memory, stage_params_per_gpu
from toolkit.models.shapes import BUILTIN_SHAPES

BF16 = Assumptions.for_precision("bf16")


def test_llama3_8b_rank16_all_linear_matches_peft():
    # PEFT's print_trainable_parameters for Llama-3-8B, r=16 on q,k,v,o,gate,up,down: "trainable params: 41,943,040"
    assert lora_params(shape=BUILTIN_SHAPES["llama3-8b"], lora=LoraShape(rank=16)) == 41_943_040


def test_subset_of_projections():
    shape = BUILTIN_SHAPES["llama3-8b"]
    qv = lora_params(shape=shape, lora=LoraShape(rank=8, projections=frozenset({"q", "v"})))
    # q: 4096 -> 4096, v: 4096 -> 1024 (8 KV heads of 128), rank 8, 32 layers
    assert qv == 32 * 8 * ((4096 + 4096) + (4096 + 1024))


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_lora_states_are_the_adapters_plus_frozen_weights(zero_stage):
    shape = BUILTIN_SHAPES["llama3-8b"]
    layout = PlanLayout(tp=2, pp=2, dp=4, zero_stage=zero_stage, micro_batch_size=1)
    lora = LoraShape(rank=16)
    full = stage_memory(shape=shape, layout=layout, training=TrainingShape(seq_length=4096, global_batch_size=32),
                        stage=0, assumptions=BF16)
    tuned = stage_memory(shape=shape, layout=layout, stage=0, assumptions=BF16,
                         training=TrainingShape(seq_length=4096, global_batch_size=32, lora=lora))
    base = stage_params_per_gpu(shape=shape, layout=layout, stage=0)
    adapters = stage_lora_params(shape=shape, lora=lora, layout=layout, stage=0).total
    expected = model_state_bytes(num_params=adapters, dp=4, zero_stage=zero_stage, assumptions=BF16)
    assert tuned.gradients == expected["gradients"] and tuned.optimizer == expected["optimizer"]
    if zero_stage < 3:
        held_base = base
        assert tuned.parameters == full.parameters + BF16.param_bytes * adapters
    else:  # this rank's quarter (dp=4) plus the norms kept whole (below the persistence threshold)
        held_base = -(-base // 4) + persistent_params(shape=shape, layout=layout, stage=0,
                                                      threshold=BF16.zero3_persistence_threshold)
        assert held_base < base / 3
    assert tuned.parameters == expected["parameters"] + BF16.param_bytes * held_base
    assert tuned.optimizer < full.optimizer / 50 and tuned.activations == full.activations
    assert tuned.params_per_gpu == base + adapters


def test_plan_cli_lora_fits_a_model_full_fine_tuning_does_not(capsys):
    from toolkit.cli import main

    args = ["plan", "llama3-70b", "--nodes", "1", "--gpus-per-node", "8", "--seq-len", "4096", "--global-batch", "64",
            "--top", "1"]
    assert main(args) == 1  # full fine-tuning of 70B does not fit one node of H100s
    capsys.readouterr()
    assert main(args + ["--lora-rank", "16"]) == 0
    out = capsys.readouterr().out
    assert "LoRA rank 16" in out and "trainable parameters" in out
    assert main(args + ["--lora-rank", "0"]) == 2
    assert "--lora-rank=0 must be at least 1" in capsys.readouterr().err


def test_emitted_spec_carries_lora(tmp_path, capsys):
    import yaml

    from toolkit.cli import main

    out = tmp_path / "job.yaml"
    assert main(["plan", "llama3-8b", "--nodes", "1", "--gpus-per-node", "8", "--seq-len", "2048",
                 "--global-batch", "16", "--lora-rank", "8", "--emit-spec", str(out)]) == 0
    assert yaml.safe_load(out.read_text())["training"]["lora"] == {"rank": 8}


def test_check_counts_the_specs_lora_targets(tmp_path):
    """`dsmt check` hands the planner the projections the spec's targets select (a config-only Llama-3-8B
    directory): q and v only hold fewer adapter bytes than every projection."""
    import json

    from toolkit.adapters.model_shape import load_model_shape
    from toolkit.check.checks import planner_inputs, check_file

    shape = BUILTIN_SHAPES["llama3-8b"]
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.num_layers, "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_kv_heads, "intermediate_size": shape.ffn_hidden_size,
        "vocab_size": shape.vocab_size, "hidden_act": "silu", "max_position_embeddings": 8192,
        "tie_word_embeddings": False}))
    assert load_model_shape(str(tmp_path / "ckpt")).num_params() == shape.num_params()
    raw = {"model": {"path": str(tmp_path / "ckpt")}, "cluster": {"gpu": "h100-80gb"},
           "parallel": {"tp": 1, "zero_stage": 1},
           "training": {"global_batch_size": 64, "micro_batch_size": 1, "seq_length": 4096,
                        "lora": {"rank": 16, "targets": ["q_proj", "v_proj"]}},
           "data": {"synthetic": True}}
    path = tmp_path / "job.json"
    path.write_text(json.dumps(raw))
    spec, report = check_file(path)
    assert report.ok, report.to_text()
    assert "LoRA rank 16 on 2 modules per layer (q_proj, v_proj)" in report.to_text()
    assert planner_inputs(spec)[1].lora == LoraShape(rank=16, projections=frozenset({"q", "v"}))
    full_raw = dict(raw, training={k: v for k, v in raw["training"].items() if k != "lora"})
    path.write_text(json.dumps(full_raw))
    full_spec, full_report = check_file(path)
    assert "memory_fit" in full_report.rules("error")  # full fine-tuning does not fit at this layout


def test_trained_embeddings_get_optimizer_state_on_the_stages_that_hold_them():
    from toolkit.plan.lora import trained_embedding_params

    shape = BUILTIN_SHAPES["llama3-8b"]  # untied: embedding and output layer, 128256 x 4096 each
    lora = LoraShape(rank=16, train_embeddings=True)
    per_copy = -(-shape.vocab_size // 2) * shape.hidden_size
    assert trained_embedding_params(shape=shape, lora=lora, tp=2, pp=1, stage=0) == 2 * per_copy
    assert [trained_embedding_params(shape=shape, lora=lora, tp=2, pp=3, stage=s) for s in range(3)] == \
        [per_copy, 0, per_copy]
    tied = dataclasses.replace(shape, tied_embeddings=True)
    assert trained_embedding_params(shape=tied, lora=lora, tp=2, pp=1, stage=0) == per_copy  # one tensor
    assert trained_embedding_params(shape=tied, lora=lora, tp=2, pp=2, stage=1) == per_copy  # the tied copy
    assert trained_embedding_params(shape=shape, lora=LoraShape(rank=16), tp=2, pp=1, stage=0) == 0
    layout = PlanLayout(tp=2, pp=2, dp=4, zero_stage=1, micro_batch_size=1)
    memory = {train: stage_memory(shape=shape, layout=layout, stage=0, assumptions=BF16, training=TrainingShape(
        seq_length=4096, global_batch_size=32, lora=LoraShape(rank=16, train_embeddings=train)))
        for train in (False, True)}
    extra = model_state_bytes(num_params=per_copy, dp=4, zero_stage=1, assumptions=BF16)
    assert memory[True].optimizer - memory[False].optimizer == extra["optimizer"]
