"""Context parallelism's plumbing on CPU (4 gloo ranks, tp1 × cp2 × dp2): everything but the attention itself,
which only Transformer Engine has (the 2-GPU run is tests/gpu/test_gpu_path.py::test_context_parallel_cp2_matches_cp1).

If any of these were wrong on GPUs the same way, CP training would silently learn from half the tokens or mis-scale
its gradients: DeepSpeed must reduce over dp × cp ranks, the loss must count every CP slice's tokens once, the CP
ranks of one replica must read the same micro-batches, and each rank must hold megatron's load-balanced slices.
This file is also the per-rank worker: `torchrun --nproc_per_node=4 test_context_parallel.py OUT`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

SEQ = 16  # 2·cp = 4 chunks of 4 tokens


def worker(out_dir: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from toolkit import backend as backends
    from toolkit.parallel.layout import Layout
    from toolkit.parallel.groups import destroy_process_groups, init_process_groups
    from toolkit.train.engine.step_inputs import context_parallel_slices, global_loss_tokens
    from toolkit.train.engine.tasks import CausalLM
    from toolkit.parallel.mpu import MegatronMpu

    init_process_groups(layout=Layout(cp=2, dp=2), dist_backend=backends.current().dist_backend)
    dp_rank = parallel_state.get_data_parallel_rank()  # what the data loader reads with (no CP)
    positions = torch.arange(SEQ).repeat(2, 1)  # two sequences of this DP rank's micro-batch
    mask = (positions % (dp_rank + 2) == 0).long()  # a different loss-token count per DP rank
    batch = {"tokens": positions + 100, "labels": positions + 200, "loss_mask": mask, "position_ids": positions}
    (sliced,) = context_parallel_slices([batch])
    report = {
        "rank": dist.get_rank(), "dp_rank": dp_rank, "cp_rank": parallel_state.get_context_parallel_rank(),
        "mpu_dp_world": MegatronMpu().get_data_parallel_world_size(),
        "positions": sliced["position_ids"][0].tolist(), "tokens_match": torch.equal(sliced["tokens"],
                                                                                   sliced["position_ids"] + 100),
        # whole micro-batches over the replicas (evaluation counts before the CP cut; training: step_inputs.global_units)
        "global_tokens": global_loss_tokens([batch], device=torch.device("cpu"), count=CausalLM(vocab_size=0).count),
        "full_tokens_this_dp_rank": int(mask.sum()),
        "deepspeed_batch": deepspeed_batch_as_parsed(),
    }
    (Path(out_dir) / f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.barrier()
    destroy_process_groups()


def deepspeed_batch_as_parsed() -> list[int]:
    """DeepSpeed's parser, given the generated config of a cp=2 dp=2 GPU spec and the live dp × cp group, must accept
    the batch identity (train_batch_size = micro × accumulation × its data-parallel group)."""
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig

    from toolkit.generate.deepspeed_config import build_deepspeed_config
    from toolkit.spec.layout import derive_layout
    from toolkit.spec.load import validate_spec
    from toolkit.parallel.mpu import MegatronMpu

    spec = validate_spec({"model": {"builtin": "llama3-8b"}, "cluster": {"gpus_per_node": 4},
                          "parallel": {"cp": 2, "zero_stage": 1},
                          "training": {"global_batch_size": 8, "micro_batch_size": 2, "seq_length": 4096},
                          "data": {"synthetic": True}}, source="cp2")
    deepspeed.init_distributed(dist_backend="gloo")  # as deepspeed.initialize does: its parser asks the mpu then
    parsed = DeepSpeedConfig(build_deepspeed_config(spec=spec, layout=derive_layout(spec)), mpu=MegatronMpu())
    return [parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps]


@pytest.mark.multiproc
def test_context_parallel_plumbing_on_four_ranks(tmp_path):
    from ranks import run_on_ranks

    run_on_ranks(__file__, tmp_path, nprocs=4, timeout=300)
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(4)]
    # megatron's rank order tp-cp-dp-pp: ranks 0, 1 are the CP pair of replica 0; 2, 3 of replica 1.
    assert [(r["dp_rank"], r["cp_rank"]) for r in reports] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["mpu_dp_world"] == 4 for r in reports)  # DeepSpeed reduces and partitions over dp × cp
    # Rank r holds chunks r and 2·cp-1-r: together the pair covers every position exactly once.
    assert reports[0]["positions"] == [0, 1, 2, 3, 12, 13, 14, 15]
    assert reports[1]["positions"] == [4, 5, 6, 7, 8, 9, 10, 11]
    assert all(r["tokens_match"] for r in reports)
    total = reports[0]["full_tokens_this_dp_rank"] + reports[2]["full_tokens_this_dp_rank"]
    assert all(r["global_tokens"] == total for r in reports)  # each token once: over the replicas, not the CP pair
    # 8 sequences = micro 2 × accumulation 2 × dp 2; DeepSpeed's group is dp × cp = 4, so it counts 8 × cp = 16
    assert all(r["deepspeed_batch"] == [16, 2, 2] for r in reports), reports


def test_context_parallel_and_fused_attention_need_transformer_engine(monkeypatch):
    from toolkit import backend as backends
    from toolkit.adapters import build
    from toolkit.adapters.family import AdapterError

    cpu = backends.Backend(name="cpu", dist_backend="gloo", use_transformer_engine=False)
    monkeypatch.setattr(backends, "current", lambda: cpu)
    with pytest.raises(AdapterError, match="parallel.cp=2 needs Transformer Engine's attention"):
        build.layer_spec(attention="local", cp_size=2)
    with pytest.raises(AdapterError, match="training.attention=fused needs Transformer Engine"):
        build.layer_spec(attention="fused")
    assert build.layer_spec(attention="local").submodules.input_layernorm is build.TorchNorm


def test_context_parallel_reaches_megatron_config_and_te_spec(monkeypatch):
    """With Transformer Engine (mocked present: its spec is only data until built) cp and the TE layers are chosen."""
    from megatron.core.models.gpt import gpt_layer_specs

    from toolkit import backend as backends
    from toolkit.adapters import build

    te = backends.Backend(name="cuda", dist_backend="nccl", use_transformer_engine=True)
    monkeypatch.setattr(backends, "current", lambda: te)
    sentinel = object()
    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec", lambda **kwargs: sentinel)
    assert build.layer_spec(attention="fused", cp_size=2) is sentinel
    assert build.layer_spec(attention=None, cp_size=2) is sentinel


if __name__ == "__main__":
    worker(sys.argv[1])
