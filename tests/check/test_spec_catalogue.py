"""The catalogue of invalid specs: each one is refused with its named rule, and the message names the values."""

import json
from pathlib import Path

import pytest

from spec_helpers import TINY_CONFIG, tiny_spec
from toolkit.cli import main
from toolkit.check.checks import check_file


PREFERENCES = Path(__file__).resolve().parents[2] / "examples" / "data" / "tiny_preferences.jsonl"


def _model(**changes):
    return {"config": {**TINY_CONFIG, **changes}}


def _llama8b(**sections):
    raw = {"model": {"builtin": "llama3-8b"}, "training": {"global_batch_size": 64}, "data": {"synthetic": True}}
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return raw


TWO_NODES = {"nodes": 2, "hosts": ["node1", "node2"]}

# name: (raw spec, rule expected among the errors, a string the messages must contain)
CATALOGUE = {
    "unknown_key": (tiny_spec(parallel={"zero_stag": 1}), "unknown_key", "zero_stage"),
    "unknown_section": ({**tiny_spec(), "paralel": {}}, "unknown_key", "parallel"),
    "two_model_sources": (tiny_spec(model={"builtin": "llama3-8b"}), "model_source", "path, builtin, config"),
    "no_model_source": (tiny_spec(model={"config": None}), "model_source", "none"),
    "unknown_builtin": (_llama8b(model={"builtin": "llama3-9b"}), "model_shape", "llama3-8b"),
    "missing_model_path": (tiny_spec(model={"config": None, "path": "/nonexistent/ckpt"}), "model_shape", "/nonexistent"),
    "bad_type": (tiny_spec(parallel={"tp": "two"}), "bad_value", "parallel.tp"),
    "bad_choice": (tiny_spec(training={"precision": "fp8"}), "bad_value", "bf16"),
    "world_size": (_llama8b(parallel={"tp": 3}), "world_size", "valid tp with pp=1, cp=1: 1, 2, 4, 8"),
    "heads_vs_tp": ({"model": {"builtin": "qwen2-7b"}, "parallel": {"tp": 8}}, "heads_vs_tp", "num_attention_heads=28"),
    "kv_heads_vs_tp": (tiny_spec(model=_model(num_attention_heads=12, num_key_value_heads=6, hidden_size=96),
                                 cluster={"gpus_per_node": 4}, parallel={"tp": 4}), "kv_heads_vs_tp", "num_kv_heads=6"),
    "ffn_vs_tp": (tiny_spec(model=_model(intermediate_size=130), cluster={"gpus_per_node": 4}, parallel={"tp": 4}),
                  "ffn_vs_tp", "ffn_hidden_size=130"),
    "layers_vs_pp": (tiny_spec(model=_model(num_hidden_layers=5), parallel={"pp": 2}), "layers_vs_pp", "num_layers=5"),
    "layers_vs_vpp": (tiny_spec(parallel={"pp": 2, "vpp": 3}), "layers_vs_pp", "pp×vpp=2×3"),
    "vpp_needs_pp": (tiny_spec(parallel={"vpp": 2}), "vpp_needs_pp", "pp > 1"),
    "vpp_microbatches": (tiny_spec(parallel={"pp": 2, "vpp": 2}, training={"global_batch_size": 2}),
                         "vpp_microbatches", "a multiple of pp=2; got 1"),
    "batch_divisibility": (_llama8b(training={"global_batch_size": 100, "micro_batch_size": 2}),
                           "batch_divisibility", "nearest valid global_batch_size: 96, 112"),
    "batch_tokens_vs_seq": (tiny_spec(training={"global_batch_size": None, "global_batch_tokens": 1000}),
                            "batch_tokens_vs_seq", "seq_length=64"),
    "batch_both": (tiny_spec(training={"global_batch_tokens": 512}), "batch_both", "not both"),
    "zero_with_pp": (tiny_spec(parallel={"pp": 2, "zero_stage": 2}), "zero_with_pp", "use zero_stage 1"),
    "sequence_parallel_needs_tp": (tiny_spec(parallel={"sequence_parallel": True}), "sequence_parallel_needs_tp", "tp=1"),
    "cp_on_cpu": (tiny_spec(parallel={"cp": 2}, cluster={"gpus_per_node": 4}), "cp_on_cpu", "Transformer Engine"),
    "cp_needs_fused_attention": (_llama8b(parallel={"cp": 2}, training={"attention": "local"}), "cp_needs_fused_attention",
                                 "training.attention=local"),
    "cp_vs_seq_length": (_llama8b(parallel={"cp": 4}, training={"seq_length": 2044}), "cp_vs_seq_length", "2×cp=8"),
    "tp_across_nodes_is_a_warning_not_an_error": (
        _llama8b(cluster=TWO_NODES | {"gpus_per_node": 4}, parallel={"tp": 8, "zero_stage": 4}), "bad_value", "zero_stage"),
    "offload_params_needs_zero3": (tiny_spec(parallel={"offload_params": True}), "offload_params_needs_zero3", "zero_stage=1"),
    "offload_optimizer_needs_zero": (tiny_spec(parallel={"zero_stage": 0, "offload_optimizer": True}),
                                     "offload_optimizer_needs_zero", "zero_stage=0"),
    "fp16_on_cpu": (tiny_spec(training={"precision": "fp16"}), "fp16_on_cpu", "fp32 or bf16"),
    "gpu_device_mismatch": (tiny_spec(cluster={"gpu": "h100-80gb"}), "gpu_device_mismatch", "gpu=cpu"),
    "unknown_gpu": (_llama8b(cluster={"gpu": "h100"}), "unknown_gpu", "h100-80gb"),
    "hosts_required": (_llama8b(cluster={"nodes": 2}), "hosts_required", "nodes=2"),
    "hosts_count": (_llama8b(cluster={"nodes": 3, "hosts": ["a", "b"]}), "hosts_count", "lists 2"),
    "duplicate_host": (_llama8b(cluster={"nodes": 2, "hosts": ["a", "a"]}), "duplicate_host", "'a'"),
    "host_injection": (_llama8b(cluster={"nodes": 2, "hosts": ["node1", "node2; rm -rf /"]}), "host_name", "rm -rf"),
    "master_addr_injection": (_llama8b(cluster={"master_addr": "$(reboot)"}), "host_name", "$(reboot)"),
    "interface_injection": (_llama8b(cluster={"network_interface": "eth0 && curl x"}), "network_interface", "eth0"),
    "env_value_injection": (_llama8b(communication={"extra_env": {"NCCL_ALGO": "Ring;id"}}), "env_value", "NCCL_ALGO"),
    "env_name": (_llama8b(communication={"extra_env": {"nccl algo": "Ring"}}), "env_name", "nccl algo"),
    "job_name_injection": (_llama8b(cluster={"job_name": "x`id`"}), "job_name", "job_name"),
    "slurm_time": (_llama8b(cluster={"slurm": {"time": "4h"}}), "slurm_time", "HH:MM:SS"),
    "slurm_setup_newline": (_llama8b(cluster={"slurm": {"setup": ["module load cuda\nrm -rf /"]}}), "slurm_line",
                            "cluster.slurm.setup"),
    "sbatch_option_dash": (_llama8b(cluster={"slurm": {"extra_sbatch": ["exclusive"]}}), "sbatch_option",
                           "starting with '-'"),
    "sbatch_option_owned": (_llama8b(cluster={"slurm": {"extra_sbatch": ["--nodes=4"]}}), "sbatch_option",
                            "set cluster.nodes instead"),
    "slurm_value": (_llama8b(cluster={"slurm": {"account": "a\nb"}}), "slurm_value", "cluster.slurm.account"),
    "loopback_multi_node": (_llama8b(cluster={**TWO_NODES, "master_addr": "127.0.0.1"}), "loopback_multi_node", "127.0.0.1"),
    "master_port_range": (_llama8b(cluster={"master_port": 80}), "bad_value", "master_port"),
    "min_lr_above_lr": (tiny_spec(training={"lr": 1e-4, "min_lr": 1e-3}), "min_lr_above_lr", "lr=0.0001"),
    "warmup_vs_steps": (tiny_spec(training={"warmup_steps": 5}), "warmup_vs_steps", "train_steps=5"),
    "export_hf_interval_not_a_checkpoint": (tiny_spec(training={"export_hf_interval": 7}),
                                            "export_hf_interval_not_a_checkpoint",
                                            "export_hf_interval=7 is not a multiple of training.checkpoint_interval=5"),
    "prompt_without_completion": (tiny_spec(data={"prompt_field": "q"}), "prompt_completion_pair", "together"),
    "messages_with_prompt": (tiny_spec(data={"messages_field": "messages", "prompt_field": "q", "completion_field": "a"}),
                             "messages_vs_prompt", "exclusive"),
    "bad_path_newline": (tiny_spec(data={"path": "a\nb", "synthetic": False}), "bad_path", "single-line"),
    "data_source": (tiny_spec(data={"synthetic": False}), "data_source", "data.synthetic: true for synthetic tokens"),
    "synthetic_with_path": (tiny_spec(data={"path": "train.jsonl"}), "synthetic_with_path",
                            "train.jsonl' are exclusive"),
    "builtin_needs_tokenizer": (_llama8b(data={"synthetic": False, "path": "train.jsonl"}), "builtin_needs_tokenizer",
                                "vocab_size=128256"),
    "lora_rank": (tiny_spec(training={"lora": {"rank": 0}}), "lora_rank", "rank=0 must be at least 1"),
    "lora_targets": (tiny_spec(model=_model(model_type="llama"), training={"lora": {"targets": ["query", "v_proj"]}}),
                     "lora_targets", "available: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"),
    "lora_needs_weights": (_llama8b(training={"lora": {"rank": 8}}), "lora_needs_weights", "model.builtin=llama3-8b"),
    "lora_rank_too_large": (tiny_spec(model=_model(model_type="llama"), training={"lora": {"rank": 200}}),
                            "lora_rank_too_large", "rank=200 is larger than the smaller side of q_proj"),
    "lora_export": (tiny_spec(training={"lora": {"train_embeddings": True, "export": "adapter"}}), "lora_export",
                    "train_embeddings with export=adapter"),
    "lora_init_adapter": (tiny_spec(model=_model(model_type="llama"),
                                    training={"lora": {"init_adapter": "/nonexistent/adapter"}}),
                          "lora_init_adapter", "adapter_config.json"),
    "validation_both": (tiny_spec(data={"synthetic": False, "path": "t.jsonl", "validation_path": "v.jsonl",
                                        "validation_fraction": 0.1}), "validation_both", "exclusive"),
    # preference tuning (toolkit/spec/preference.py, toolkit/check/preference_checks.py)
    "dpo_beta": (tiny_spec(training={"method": "dpo", "dpo": {"beta": 0}}), "dpo_beta", "beta=0"),
    "dpo_label_smoothing": (tiny_spec(training={"method": "dpo", "dpo": {"loss": "ipo", "label_smoothing": 0.1}}),
                            "dpo_label_smoothing", "applies to the sigmoid loss only"),
    "dpo_without_method": (tiny_spec(training={"dpo": {"beta": 0.2}}), "dpo_without_method", "training.method=sft"),
    "simpo_without_method": (tiny_spec(training={"simpo": {"beta": 2.0}}), "dpo_without_method",
                             "training.simpo is set but training.method=sft"),
    "dpo_data_type": (tiny_spec(training={"method": "dpo"}), "dpo_data_type", "data.synthetic=true"),
    "preference_needs_dpo": (tiny_spec(data={"synthetic": False, "type": "preference", "path": str(PREFERENCES)}),
                             "preference_needs_dpo", "training.method=sft"),
    "dpo_context_parallel": (tiny_spec(training={"method": "dpo"}, parallel={"cp": 2},
                                       data={"synthetic": False, "type": "preference", "path": str(PREFERENCES)}),
                             "dpo_context_parallel", "parallel.cp=2"),
    "dpo_lora_embeddings": (tiny_spec(model=_model(model_type="llama"), data={"synthetic": False, "type": "preference", "path": str(PREFERENCES)},
                                      training={"method": "dpo", "lora": {"train_embeddings": True}}),
                            "dpo_lora_embeddings", "would move with the policy"),
    "dpo_reference": (tiny_spec(training={"method": "dpo", "dpo": {"reference": "/nonexistent/sft"}},
                                data={"synthetic": False, "type": "preference", "path": str(PREFERENCES)}),
                      "dpo_reference", "neither base, precomputed nor an HF checkpoint"),
}


@pytest.mark.parametrize("name", sorted(CATALOGUE))
def test_invalid_spec_gets_its_named_error(name, write_spec):
    raw, rule, needle = CATALOGUE[name]
    _, report = check_file(write_spec(raw))
    assert rule in report.rules("error"), report.to_text()
    assert needle in report.to_text(), report.to_text()


def test_catalogue_is_large_enough():
    assert len(CATALOGUE) >= 20
    assert len({rule for _, rule, _ in CATALOGUE.values()}) >= 20


def test_all_problems_reported_at_once(write_spec):
    raw = {"model": {"builtin": "qwen2-7b"}, "cluster": TWO_NODES,
           "parallel": {"tp": 3, "pp": 2, "zero_stage": 2}, "training": {"global_batch_size": 100}}
    _, report = check_file(write_spec(raw))
    assert {"world_size", "heads_vs_tp", "kv_heads_vs_tp", "ffn_vs_tp", "zero_with_pp"} <= report.rules("error")


def test_warnings_do_not_fail(write_spec):
    raw = _llama8b(cluster=TWO_NODES | {"gpus_per_node": 4}, parallel={"tp": 8},
                   training={"seq_length": 16384, "train_steps": 400, "warmup_steps": 10})
    _, report = check_file(write_spec(raw))
    assert report.ok, report.to_text()
    assert {"tp_crosses_nodes", "seq_length_vs_positions"} <= report.rules("warning")
    # 400 steps under the default interval of 500: the end of the run is saved (below), so a fact, not a warning
    assert "no_checkpoint" in report.rules("info") and "no_checkpoint" not in report.rules("warning")


def test_a_folder_that_is_not_a_model_says_what_it_holds(tmp_path, write_spec):
    (tmp_path / "models" / "llama").mkdir(parents=True)  # model.path one level too high
    (tmp_path / "models" / "llama" / "config.json").write_text("{}")
    _, report = check_file(write_spec(tiny_spec(model={"config": None, "path": str(tmp_path / "models")})))
    [problem] = report.errors
    assert problem.rule == "model_shape" and problem.message.endswith(
        "is a folder but not an HF checkpoint: it has no config.json (it holds llama/); these sub-folders of it have "
        "one: llama"), problem.message


def test_a_run_shorter_than_checkpoint_interval_saves_its_last_step(monkeypatch):
    """What makes interval > train_steps harmless: the training loop saves the last step whatever the interval."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from toolkit.train.job import loop

    saved = []
    monkeypatch.setattr(dist, "get_rank", lambda *args, **kwargs: 0)
    training = SimpleNamespace(train_steps=3, checkpoint_interval=500, eval_interval=None, keep_checkpoints=2,
                               export_hf_interval=None, async_save=False)
    trainer = SimpleNamespace(engine=None, train_step=lambda batch: {},
                              save=lambda checkpoint_dir, **kwargs: saved.append(kwargs["step"]))
    loop.train_steps(trainer=trainer, batches=SimpleNamespace(batches_for_step=lambda step: None),
                     spec=SimpleNamespace(training=training), log=SimpleNamespace(step=lambda **kwargs: None),
                     start=0, output_dir=Path("unused"))
    assert saved == [3]


def test_memory_hook_reports_an_info_line(write_spec):
    _, report = check_file(write_spec(tiny_spec()))
    assert [p.message for p in report.problems if p.rule == "memory_fit"][0].startswith("memory fit:")


def test_check_cli_exit_codes_and_json(write_spec, capsys):
    good, bad = write_spec(tiny_spec(), name="good.yaml"), write_spec(tiny_spec(parallel={"pp": 3}), name="bad.yaml")
    assert main(["check", good]) == 0
    assert main(["check", good, "--set", "parallel.pp=3"]) == 2
    capsys.readouterr()
    assert main(["check", "--json", good, bad]) == 2
    reports = json.loads(capsys.readouterr().out)
    assert [r["ok"] for r in reports] == [True, False]
    assert "layers_vs_pp" in {p["rule"] for p in reports[1]["problems"]}


def test_sync_batchnorm_on_a_transformer_is_a_warning_naming_it(tmp_path):
    path = tmp_path / "job.json"
    path.write_text(json.dumps(tiny_spec(training={"sync_batchnorm": True})))
    spec, report = check_file(path)
    assert report.ok and report.rules("warning") >= {"sync_batchnorm_no_batchnorm"}
    path.write_text(json.dumps(tiny_spec()))
    assert "sync_batchnorm_no_batchnorm" not in check_file(path)[1].rules("warning")


def test_export_hf_interval_on_checkpoint_steps_passes_and_names_the_multiples(write_spec):
    _, report = check_file(write_spec(tiny_spec(training={"export_hf_interval": 10})))
    assert report.ok and "export_hf_interval_not_a_checkpoint" not in report.rules("error"), report.to_text()
    _, report = check_file(write_spec(tiny_spec(training={"export_hf_interval": 12})))
    [problem] = [p for p in report.errors if p.rule == "export_hf_interval_not_a_checkpoint"]
    assert "a multiple of 5 (10 or 15), or training.checkpoint_interval to a divisor of 12" in problem.fix, problem
    _, report = check_file(write_spec(tiny_spec(training={"export_hf_interval": 3})))
    assert "a multiple of 5 (5)," in report.to_text(), report.to_text()


def test_a_dpo_reference_of_other_shapes_is_named_before_any_rank_starts(tmp_path, write_spec):
    from toolkit.models.tiny import make_tiny_checkpoint

    policy = make_tiny_checkpoint(tmp_path / "policy", model_type="llama", seed=1)
    other = make_tiny_checkpoint(tmp_path / "other", model_type="llama", num_hidden_layers=2, seed=2)
    data = {"synthetic": False, "type": "preference", "path": str(PREFERENCES)}
    raw = tiny_spec(model={"config": None, "path": str(policy)}, data=data,
                    training={"method": "dpo", "dpo": {"reference": str(other)}})
    _, report = check_file(write_spec(raw))
    [problem] = [p for p in report.errors if p.rule == "dpo_reference"]
    assert "num_layers 2 (policy 4)" in problem.message or "num_layers 2 (policy" in problem.message, problem.message
    raw["training"]["dpo"]["reference"] = str(policy)  # the policy's own checkpoint is a valid reference
    _, report = check_file(write_spec(raw))
    assert "dpo_reference" not in report.rules("error") and report.ok, report.to_text()
