"""ZeRO-3 under Transformer Engine's layers, on a machine without TE: megatron's TE layer spec built from
TE-shaped stand-ins (tests/train/te_standins.py: TE's class names, parameters, `_extra_state` and megatron's
sharded state dicts of them) through dsmt's own TE branch (`training.attention: fused`), against the same at
ZeRO-1 and megatron's local layers. What the stand-ins do not reproduce is in their module's docstring.

One 2-rank launch (`_worker`) runs, in one process group, on a tiny Llama whose vocabulary is padded (250 -> 256)
and packed records (TE's THD path: one row per micro-batch, so GPTModel's output is a view of the logits; before
the padded vocabulary was masked in the output layer this crashed ZeRO-1's reduction, see
`test_a_hook_on_the_models_output_fires_when_the_logits_are_a_view`):
    probe          built partitioned at DP2 ZeRO-3 with TE's layers and loaded one parameter at a time, against an
                   unpartitioned build of the local layers and the HF tensors themselves
    te-zero1       TE layers, DP2 ZeRO-1, 4 steps, checkpoints at 2 and 4
    te-zero3       TE layers, DP2 ZeRO-3 (every parameter partitioned), the same 4 steps
    te-zero3-cut   a copy of te-zero3 cut back to its step-2 checkpoint, resumed at ZeRO-3
    local-zero1    megatron's local layers, DP2 ZeRO-1, the same 4 steps
    reload         te-zero3's final-mcore (megatron's dist checkpoint of TE's sharded state dict, extra states in)
                   loaded into TE's layers, against its final-hf loaded into the local layers
"""

import json
import sys
from pathlib import Path

import pytest
import torch

from toolkit.models.tiny import make_tiny_checkpoint
from train_helpers import cut_back, read_metrics, write_spec

HELPERS = Path(__file__).resolve().parents[1]  # tests/train: train_helpers, te_standins
THRESHOLD_0 = {"communication": {"param_persistence_threshold_elements": 0}}  # every parameter partitioned
FP32_LOSS = 1e-5  # TE's and the local attention differ in fp32 rounding only (seen: <= 2.6e-7)
# Tensors the local layers keep in modules of their own and TE's layers fuse into the linear after them, or that
# load without a transform: HF name -> canonical megatron name, per layer, the same values.
SAME_AS_HF = {"model.layers.{}.input_layernorm.weight": "decoder.layers.{}.self_attention.linear_qkv.layer_norm_weight",
              "model.layers.{}.post_attention_layernorm.weight": "decoder.layers.{}.mlp.linear_fc1.layer_norm_weight",
              "model.layers.{}.mlp.down_proj.weight": "decoder.layers.{}.mlp.linear_fc2.weight"}


def _spec(root: Path, name: str, *, zero: int, attention: str = "fused") -> str:
    extra = {"training": {"attention": attention, "lr_schedule": "cosine", "lr": 3e-3, "min_lr": 3e-4,
                          "grad_clip": 1.0}, **THRESHOLD_0}
    return str(write_spec(root / f"{name}.yaml", model_dir=root / "model", output_dir=root / name, dp=2, zero=zero,
                          steps=4, checkpoint_interval=2, extra=extra))


@pytest.fixture(scope="module")
def te_runs(tmp_path_factory):
    from ranks import run_on_ranks

    root = tmp_path_factory.mktemp("zero3-te")
    # vocab 250, padded to 256: packed micro-batches are one THD row, a view of the logits (see the test below)
    make_tiny_checkpoint(root / "model")
    plan = [("probe", _spec(root, "probe", zero=3), str(root / "probe")),
            ("train", _spec(root, "te-zero1", zero=1)),
            ("train", _spec(root, "te-zero3", zero=3)),
            ("cut", str(root / "te-zero3"), str(root / "te-zero3-cut"), 2),
            ("train", _spec(root, "te-zero3-cut", zero=3)),
            ("train", _spec(root, "local-zero1", zero=1, attention="local")),
            ("reload", _spec(root, "reload", zero=1), str(root / "te-zero3"), str(root / "reload"))]
    (root / "plan.json").write_text(json.dumps(plan))
    result = run_on_ranks(__file__, root / "plan.json", nprocs=2, timeout=600)
    return root, result.stdout + result.stderr


@pytest.mark.multiproc
def test_te_layers_build_partitioned_and_load_the_checkpoint(te_runs):
    root, _ = te_runs
    for rank in range(2):
        report = json.loads((root / f"probe{rank}.json").read_text())
        print(f"rank {rank}: {report}")
        # dsmt's TE branch built TE's classes (and TENorm as the final norm), each with its extra state
        assert report["te_classes"] == {"TELayerNormColumnParallelLinear": 8, "TERowParallelLinear": 8,
                                        "TEDotProductAttention": 4, "final norm": 1}
        assert report["extra_in_state_dict"] == 21
        # megatron's sharded state dicts keep the linears' and the norm's extra state, never attention's
        assert report["extra_in_sharded"] == 17 and report["attention_extra_in_sharded"] == 0
        assert report["partitioned"] == report["parameters"] == 27
        # the canonical names of the local layers (the fused norms under TE's names), the same values, the HF ones
        assert report["names_missing"] == [] and report["names_extra"] == []
        assert report["max_abs_diff_vs_local"] == 0.0
        assert report["same_as_hf_checked"] == 3 * 4 and report["max_abs_diff_vs_hf"] == 0.0


@pytest.mark.multiproc
def test_te_zero3_trains_like_te_zero1_and_the_local_layers(te_runs):
    root, _ = te_runs
    losses = {name: [m["loss"] for m in read_metrics(root / name)] for name in ("te-zero1", "te-zero3", "local-zero1")}
    print(losses)
    assert len(losses["te-zero3"]) == 4 and losses["te-zero3"][-1] < losses["te-zero3"][0] - 0.3
    assert losses["te-zero3"] == pytest.approx(losses["te-zero1"], abs=FP32_LOSS)
    assert losses["te-zero1"] == pytest.approx(losses["local-zero1"], abs=FP32_LOSS)
    from safetensors.torch import load_file

    exported = {name: load_file(root / name / "final-hf" / "model.safetensors") for name in losses}
    assert set(exported["te-zero3"]) == set(exported["te-zero1"]) == set(exported["local-zero1"])
    for name in ("te-zero1", "local-zero1"):
        worst = max((exported["te-zero3"][k] - exported[name][k]).abs().max().item() for k in exported[name])
        print(f"max |Δweight| te-zero3 vs {name}: {worst:.2e}")
        assert worst < 1e-5


@pytest.mark.multiproc
def test_te_zero3_resume_continues_bit_exactly(te_runs):
    root, output = te_runs
    uninterrupted, resumed = read_metrics(root / "te-zero3"), read_metrics(root / "te-zero3-cut")
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]  # the cut kept steps 1-2: 3 and 4 were trained again
    assert any("resuming after step 2" in line for line in output.splitlines())
    for mine, theirs in zip(resumed[2:], uninterrupted[2:]):
        assert (mine["loss"], mine["grad_norm"], mine["lr"]) == (theirs["loss"], theirs["grad_norm"], theirs["lr"])
    from safetensors.torch import load_file

    ours, theirs = (load_file(root / name / "final-hf" / "model.safetensors") for name in ("te-zero3-cut", "te-zero3"))
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs)


@pytest.mark.multiproc
def test_te_checkpoints_keep_the_fused_norm_names_and_the_extra_state_where_megatron_does(te_runs):
    """The sharded optimizer state (toolkit/train/checkpoint/sharded.py) keys TE's parameters by megatron's
    layout-free names (the norms under the linears they are fused into) and skips the extra state; the final-mcore
    export (megatron's dist checkpoint, gathered from ZeRO-3) keeps it, and loads back into TE's layers."""
    root, _ = te_runs
    shapes = {name: json.loads((root / name / "checkpoints" / "step_000004" / "state" / "index.json").read_text())
              ["shapes"] for name in ("te-zero1", "te-zero3")}
    assert shapes["te-zero1"] == shapes["te-zero3"]
    assert {"decoder.layers.self_attention.linear_qkv.layer_norm_weight",
            "decoder.layers.mlp.linear_fc1.layer_norm_weight"} <= set(shapes["te-zero3"])
    assert not [key for key in shapes["te-zero3"] if "extra_state" in key]
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(root / "te-zero3" / "final-mcore" / "model")).read_metadata().state_dict_metadata
    extra = sorted(key for key in saved if "_extra_state" in key)  # one object per layer: `<key>/shard_<layer>_4`
    print(extra)
    assert len(extra) == 4 * 4 + 1 and "decoder.final_layernorm._extra_state/shard_0_1" in extra
    assert not [key for key in extra if "core_attention" in key]
    for rank in range(2):
        report = json.loads((root / f"reload{rank}.json").read_text())
        assert report == {"names": 27, "max_abs_diff_vs_final_hf": 0.0}, report


@pytest.mark.parametrize("rows", ["one row", "packed rows as one THD row"])
def test_a_hook_on_the_models_output_fires_when_the_logits_are_a_view(megatron_tp1, rows):
    """DeepSpeed 0.19 runs its backward prologue (the gradient-accumulation boundary ZeRO-1/2 reduce by, its hook
    state) from a hook on the tensor `engine.forward` returns. Skipped, a micro-batch's gradients are reduced by
    the previous micro-batch's boundary: with TE's layers, packed and unpacked micro-batches in one step (or on
    two DP ranks) reduce different buckets, a collective mismatch (seen at DP2 ZeRO-1 on gloo: 'Received data
    size doesn't match expected size', 296064 vs 148032). GPTModel's output for one row is a view of the output
    layer's logits: the padded vocabulary is masked in the output layer (toolkit/adapters/vocab_mask.py), before the
    view, and the loss writes nothing into the view, so the hook keeps firing. (Masking in place in the loss, as
    dsmt did, drops it: the first assertion's failure.)"""
    from toolkit.adapters.vocab_mask import PaddedVocabMask
    from toolkit.train.engine.loss import masked_token_loss_sum

    torch.manual_seed(0)
    output_layer = torch.randn(8, 256, requires_grad=True)  # vocab 250 padded to 256, as the tiny Llama's
    logits = torch.randn(16, 1, 8) @ output_layer  # [s, b=1, vocab]
    PaddedVocabMask(vocab_size=250, padded_vocab_size=256)(None, None, (logits, None))  # the output layer's hook
    output = logits.transpose(0, 1)  # what GPTModel returns: [b, s, vocab], a view when b == 1
    assert output._base is logits
    fired = []
    output.register_hook(lambda grad: fired.append(grad))  # as DeepSpeed's OutputBackwardHookManager
    rows_of = output.reshape(2, 8, 256) if rows != "one row" else output  # tasks.thd_forward's [rows, length]
    labels = torch.randint(0, 250, rows_of.shape[:2])
    # HF's loss: no padded rows at all (read before the loss, which consumes fp32 logits in place)
    expected = torch.nn.functional.cross_entropy(logits.detach()[:, 0, :250], labels.reshape(-1), reduction="sum")
    loss = masked_token_loss_sum(rows_of, labels=labels, loss_mask=torch.ones_like(labels))
    loss.backward()
    assert fired, "the hook on the model's output did not fire in backward"
    assert output_layer.grad[:, 250:].abs().max() == 0 and output_layer.grad[:, :250].abs().max() > 0
    assert torch.allclose(loss.detach(), expected, rtol=1e-5)


def _probe(spec_path: str, out_prefix: str) -> None:
    """This rank's build at ZeRO-3 with TE's layers, against the local layers and the HF tensors."""
    import deepspeed
    import torch
    from safetensors.torch import load_file

    from toolkit.adapters.load import canonical_parameters, canonical_tensors
    from toolkit.convert.chunks import load_model_chunks
    from toolkit.generate.deepspeed_config import build_deepspeed_config

    spec, layout, parallel = _groups(spec_path)
    model_dir = Path(spec.model.path)
    chunks, _ = load_model_chunks(checkpoint=model_dir, layout=parallel, params_dtype=torch.float32,
                                  attention="fused", zero3_config=build_deepspeed_config(spec=spec, layout=layout))
    local, _ = load_model_chunks(checkpoint=model_dir, layout=parallel, params_dtype=torch.float32, attention="local")
    params, expected = canonical_parameters(chunks), canonical_tensors(local)
    hf = load_file(model_dir / "model.safetensors")
    worst_local = worst_hf = 0.0
    checked = 0
    for name, param in params.items():
        layer = name.split(".")[2] if name.startswith("decoder.layers.") else None
        same = [hf_name.format(layer) for hf_name, ours in SAME_AS_HF.items() if name == ours.format(layer)]
        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            worst_local = max(worst_local, (param.data - expected[name]).abs().max().item())
            for hf_name in same:
                worst_hf = max(worst_hf, (param.data - hf[hf_name]).abs().max().item())
                checked += 1
    report = {**_te_modules(chunks[0]), "parameters": len(params),
              "partitioned": sum(hasattr(p, "ds_id") and p.numel() == 0 for p in params.values()),
              "names_missing": sorted(set(expected) - set(params)), "names_extra": sorted(set(params) - set(expected)),
              "max_abs_diff_vs_local": worst_local, "max_abs_diff_vs_hf": worst_hf, "same_as_hf_checked": checked}
    _write(out_prefix, report)


def _te_modules(chunk) -> dict:
    """The stand-ins in `chunk` by class, and where their `_extra_state` is kept."""
    import te_standins

    from toolkit.adapters.load import full_shape_standins

    te = {name: module for name, module in chunk.named_modules() if type(module).__module__ == te_standins.__name__}
    with full_shape_standins(list(chunk.parameters())):  # megatron checks shapes; ZeRO-3 data is empty
        sharded = chunk.sharded_state_dict()
    state = chunk.state_dict()
    classes: dict[str, int] = {}
    for name, module in te.items():
        kind = "final norm" if name == "decoder.final_layernorm" else type(module).__name__
        classes[kind] = classes.get(kind, 0) + 1
    attention = [name for name, module in te.items() if type(module).__name__ == "TEDotProductAttention"]
    return {"te_classes": classes, "extra_in_state_dict": sum(f"{name}._extra_state" in state for name in te),
            "extra_in_sharded": sum(f"{name}._extra_state" in sharded for name in te),
            "attention_extra_in_sharded": sum(f"{name}._extra_state" in sharded for name in attention)}


def _reload(spec_path: str, run_dir: str, out_prefix: str) -> None:
    """A run's final-mcore into TE's layers (megatron's dist checkpoint load, strict), against its final-hf in the
    local layers."""
    import torch

    from toolkit.adapters.load import canonical_tensors
    from toolkit.convert.chunks import load_model_chunks

    _, _, parallel = _groups(spec_path)
    te, _ = load_model_chunks(checkpoint=Path(run_dir) / "final-mcore", layout=parallel, params_dtype=torch.float32,
                              attention="fused")
    local, _ = load_model_chunks(checkpoint=Path(run_dir) / "final-hf", layout=parallel, params_dtype=torch.float32,
                                 attention="local")
    ours, expected = canonical_tensors(te), canonical_tensors(local)
    assert set(ours) == set(expected), sorted(set(ours) ^ set(expected))
    _write(out_prefix, {"names": len(ours),
                        "max_abs_diff_vs_final_hf": max((ours[k] - expected[k]).abs().max().item() for k in ours)})


def _groups(spec_path: str):
    """(spec, derived layout, parallel Layout) with this rank's process groups made for the spec's layout."""
    from toolkit import backend as backends
    from toolkit.parallel.groups import Layout, init_process_groups
    from toolkit.spec.layout import derive_layout
    from toolkit.spec.load import load_spec

    spec = load_spec(spec_path)
    layout = derive_layout(spec)
    parallel = Layout(**layout.parallel_fields())
    init_process_groups(layout=parallel, dist_backend="gloo")
    backends.current().seed(spec.training.seed)
    return spec, layout, parallel


def _write(out_prefix: str, report: dict) -> None:
    import torch.distributed as dist

    Path(f"{out_prefix}{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.barrier()


def _worker(plan_path: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    import te_standins
    from toolkit.check.job import job_of
    from toolkit.errors import Report
    from toolkit.spec.load import load_spec
    from toolkit.train.job.run import train

    dist.init_process_group("gloo")
    te_standins.install()
    for action, *args in json.loads(Path(plan_path).read_text()):
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if action in ("probe", "reload"):
            {"probe": _probe, "reload": _reload}[action](*args)
        elif action == "cut":
            if dist.get_rank() == 0:
                cut_back(Path(args[0]), Path(args[1]), to_step=args[2], trim_metrics=True)
            dist.barrier()
        else:
            train(job=job_of(spec=load_spec(args[0]), report=Report(source=args[0], problems=())))
    dist.barrier()


if __name__ == "__main__":
    sys.path.insert(0, str(HELPERS))
    _worker(sys.argv[1])
