"""ZeRO-3 for real: every parameter partitioned (persistence threshold 0), chunks built partitioned and loaded one
parameter at a time, and a DP2 ZeRO-3 run training exactly like the same run at ZeRO-1.

This file is also the per-rank probe: `torchrun ... test_train_zero3.py SPEC OUT_DIR` builds and loads the tiny
Llama at ZeRO-3 and writes what it measured to OUT_DIR/rank{r}.json."""

import json
import sys
from pathlib import Path

import pytest

from train_helpers import read_metrics, run_dsmt, write_spec

pytestmark = pytest.mark.multiproc
THRESHOLD_0 = {"communication": {"param_persistence_threshold_elements": 0}}


def probe(spec_path: str, out_dir: str) -> None:
    """One rank: build + load at ZeRO-3 with the peak tracked, compare every value with an unpartitioned load,
    then hand the chunks to the engine and check they stay partitioned."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from toolkit import backend as backends
    from tests.plan.live_tensors import BuildTracker  # the repository is on the ranks' path (tests/ranks.py)
    from toolkit.adapters.load import canonical_parameters, canonical_tensors
    from toolkit.generate.deepspeed_config import build_deepspeed_config
    from toolkit.convert.chunks import load_model_chunks
    from toolkit.parallel.groups import Layout, init_process_groups
    from toolkit.spec.layout import derive_layout
    from toolkit.spec.load import load_spec
    from toolkit.train.engine.hybrid import HybridEngine

    spec = load_spec(spec_path)
    layout = derive_layout(spec)
    parallel = Layout(**layout.parallel_fields())
    init_process_groups(layout=parallel, dist_backend="gloo")
    backends.current().seed(spec.training.seed)
    ds_config = build_deepspeed_config(spec=spec, layout=layout)
    with BuildTracker() as tracker:
        chunks, info = load_model_chunks(checkpoint=Path(spec.model.path), layout=parallel,
                                         params_dtype=torch.float32, zero3_config=ds_config)
    params = canonical_parameters(chunks)
    dp = parallel_state.get_data_parallel_world_size()
    layers = {}
    for name, p in params.items():
        key = name.split(".")[2] if name.startswith("decoder.layers.") else name
        layers[key] = layers.get(key, 0) + p.ds_numel
    report = {
        "dp": dp,
        "total": sum(p.ds_numel for p in params.values()),
        "share": sum(p.ds_tensor.numel() for p in params.values()),
        "largest_module": max(layers.values()),
        "peak": tracker.peak_elements,
        "partition_ok": all(p.numel() == 0 and p.ds_tensor.numel() == -(-p.ds_numel // dp) for p in params.values()),
    }
    with BuildTracker() as unpartitioned:
        reference, _ = load_model_chunks(checkpoint=Path(spec.model.path), layout=parallel, params_dtype=torch.float32)
    report["peak_unpartitioned"] = unpartitioned.peak_elements
    expected, worst = canonical_tensors(reference), 0.0
    for name, p in params.items():
        with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
            worst = max(worst, (p.data - expected[name]).abs().max().item())
    report["max_abs_diff_vs_unpartitioned"] = worst
    hybrid = HybridEngine(chunks=chunks, ds_config=ds_config, vocab_size=info.settings.vocab_size,
                          tied_embeddings=info.settings.tied_embeddings, pp_size=1)
    report["engine_kept_partitions"] = all(
        a is b and b.numel() == 0 for a, b in zip(params.values(), canonical_parameters(hybrid.chunks).values()))
    (Path(out_dir) / f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.barrier()


@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "tp2-dp2"])
def test_zero3_builds_partitioned_and_loads_one_parameter_at_a_time(tp, tiny_llama, tmp_path):
    spec = write_spec(tmp_path / "job.yaml", model_dir=tiny_llama, output_dir=tmp_path / "out", tp=tp, dp=2, zero=3,
                      extra=THRESHOLD_0)
    from ranks import run_on_ranks  # tests/ranks.py (the test's import path, not the ranks')

    run_on_ranks(__file__, spec, tmp_path, nprocs=2 * tp, timeout=600)
    for rank in range(2 * tp):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        print(f"rank {rank}: {report}")
        assert report["partition_ok"], "every parameter holds only its 1/dp partition outside a gather"
        assert report["max_abs_diff_vs_unpartitioned"] == 0.0
        assert report["engine_kept_partitions"]
        # Peak materialised parameter elements: this rank's share plus one module (a layer or the embedding),
        # where the unpartitioned build holds the whole model.
        assert report["peak"] <= report["share"] + report["largest_module"] < report["total"]
        assert report["peak_unpartitioned"] == report["total"]  # the tracker sees a whole build


def test_zero3_dp2_trains_like_zero1(tiny_llama, tmp_path):
    runs = {}
    for zero in (1, 3):
        spec = write_spec(tmp_path / f"zero{zero}.yaml", model_dir=tiny_llama, output_dir=tmp_path / f"zero{zero}",
                          dp=2, zero=zero, extra=THRESHOLD_0)
        run_dsmt(spec)
        runs[zero] = [r["loss"] for r in read_metrics(tmp_path / f"zero{zero}")]
    print("zero1", runs[1], "zero3", runs[3])
    assert len(runs[3]) == 5 and runs[3][-1] < runs[3][0]
    # Observed: equal to the last digit. A drift of ~1e-4 by step 5 is ZeRO-3 applying no weight decay at all:
    # a partitioned parameter's data is 1-D and empty, so grouping must use its full shape (`param.ds_shape`).
    assert runs[3] == pytest.approx(runs[1], abs=1e-5), "weight decay groups built from partitioned shapes?"
    from safetensors.torch import load_file

    zero1 = load_file(tmp_path / "zero1" / "final-hf" / "model.safetensors")
    zero3 = load_file(tmp_path / "zero3" / "final-hf" / "model.safetensors")
    assert sorted(zero1) == sorted(zero3)
    worst = max((zero1[k] - zero3[k]).abs().max().item() for k in zero1)
    print("max |Δweight| zero3 vs zero1 export", worst)
    assert worst < 1e-5
    assert (tmp_path / "zero3" / "final-mcore" / "dsmt_checkpoint.json").is_file()


if __name__ == "__main__":
    probe(sys.argv[1], sys.argv[2])
