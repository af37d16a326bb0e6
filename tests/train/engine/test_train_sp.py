"""Sequence parallelism (megatron-core's `sequence_parallel` with TP) computes what TP without it computes.

Under SP each TP rank holds a slice of the sequence around the norms, so a norm weight's gradient is partial per
rank; the engine sums those gradients over TP before DeepSpeed reduces over DP (toolkit/train/engine/hybrid.py).

One 4-rank gloo launch (imports cost ~6 s per process) runs everything; this file is also its per-rank worker
(`torchrun ... test_train_sp.py PLAN.json`):
  1. gradient parity without DeepSpeed: the tiny Llama at TP2 (PP1 with megatron's no-pipelining schedule, PP2
     with its 1F1B schedule) with and without SP, each recompute mode, the same micro-batches; every parameter's
     gradient compared. A control with the TP sum switched off shows that the comparison sees a missing sum.
  2. training parity through the real path, `toolkit.train.job.run.train(spec=...)` (spec -> layout -> build ->
     engine -> export): fp32, 4 optimizer steps with a cosine LR, weight decay and clipping that acts; per-step
     loss and grad norm, and the exported final-hf weights, of each SP run against TP2 without SP. PP2 at ZeRO-1
     (megatron's schedule, one `engine.step()` after it), PP1 x DP2 at ZeRO-2 and ZeRO-3 (DeepSpeed's loop,
     gradients reduced during backward in its hooks), with selective recompute and without; and a control run
     without the TP sum, which the comparison must catch.
The pure tests at the end check what must hold on GPU with Transformer Engine, where this machine cannot run it.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import types
from pathlib import Path

import pytest
import torch

SEED, MICRO, SEQ, NUM_MICRO = 7, 2, 32, 2
STEPS = 4  # one warm-up step at lr 0 fills Adam's moments (see test_train_bert.py): 3 steps move the weights
# 2e-3 cosine to 2e-4; clipping at 0.5 acts on every step (norms ~2-3), so a wrong grad norm moves the weights.
TRAINING = {"lr": 2e-3, "min_lr": 2e-4, "lr_schedule": "cosine", "warmup_steps": 1, "weight_decay": 0.1,
            "grad_clip": 0.5, "train_steps": STEPS}
THRESHOLD_0 = {"param_persistence_threshold_elements": 0}  # ZeRO-3 really partitions every parameter

# ZeRO-2/3 with small buckets: DeepSpeed reduces gradients during backward, in its hooks, as they fill a bucket.
SMALL_BUCKETS = {"reduce_bucket_elements": 1000}
SP_RUN = {"sp": True}
# Each run without SP is a reference; each SP run names the reference it must equal (`against`). Runs cost ~5 s
# each, so references are shared where the arithmetic is the same (measured): recompute changes none of it, and
# ZeRO-3 differs from ZeRO-2 by <= 1.3e-7 in grad norm and 1.2e-7 in weights. Full recompute is in GRAD_CASES.
RUNS = {
    # PP2: megatron's 1F1B schedule, then one engine.step() that reduces over DP; ZeRO-1
    "tp2-pp2-zero1-selective": dict(pp=2, dp=1, zero=1, recompute="selective"),
    "tp2-pp2-zero1-selective-sp": dict(pp=2, dp=1, zero=1, recompute="selective", **SP_RUN,
                                       against="tp2-pp2-zero1-selective"),
    # PP1: DeepSpeed's own loop; ZeRO-2/3 reduce (and ZeRO-3 partitions) gradients in hooks during backward
    "tp2-dp2-zero2-selective": dict(dp=2, zero=2, recompute="selective"),
    "tp2-dp2-zero2-selective-sp": dict(dp=2, zero=2, recompute="selective", **SP_RUN,
                                       against="tp2-dp2-zero2-selective"),
    "tp2-dp2-zero3-sp": dict(dp=2, zero=3, **SP_RUN, against="tp2-dp2-zero2-selective"),
    # The control: SP with the engine's TP sum switched off.
    "tp2-dp2-zero2-selective-sp-unsummed": dict(dp=2, zero=2, recompute="selective", **SP_RUN,
                                                against="tp2-dp2-zero2-selective", unsummed=True),
}
# Gradient parity (no DeepSpeed): both megatron schedules and every recompute mode.
GRAD_CASES = [(1, "none"), (1, "full"), (2, "selective")]

# Measured (fp32, 2 CPU cores): gradients <= 4.7e-10 (largest 9.0e-2; only the norms' differ: the TP sum adds
# the two halves of the sequence in another order); against the same ZeRO stage losses and grad norms equal,
# weights <= 6.0e-8 (one float32 ulp at their magnitude); ZeRO-3 + SP against ZeRO-2: loss 4.8e-7, grad norm
# 1.3e-7, weights 1.2e-7. The tolerances allow a few ulps at each quantity's magnitude.
GRAD_TOLERANCE = 1e-8
LOSS_TOLERANCE = 2e-6  # losses ~5.5, where a float32 ulp is 4.8e-7
GRAD_NORM_TOLERANCE = 1e-6  # norms 2-3, ulp 2.4e-7
WEIGHT_TOLERANCE = 5e-7
CONTROL_MINIMUM = 1e-4  # a missing TP sum moves the norm gradients / weights by far more than the tolerances


# --- the per-rank worker ----------------------------------------------------------------------------------------

def reset_parallel_state(layout) -> None:
    from megatron.core import parallel_state

    from toolkit.parallel.groups import init_process_groups

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    init_process_groups(layout=layout, dist_backend="gloo")


def fixed_micro_batches(*, dp_rank: int, vocab_size: int) -> list[dict]:
    """The same micro-batches on every TP / PP rank of a data-parallel replica, different across replicas."""
    generator = torch.Generator().manual_seed(1000 + dp_rank)
    batches = []
    for _ in range(NUM_MICRO):
        tokens = torch.randint(0, vocab_size, (MICRO, SEQ + 1), generator=generator)
        batches.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                        "loss_mask": (torch.rand(MICRO, SEQ, generator=generator) > 0.2).float(),
                        "position_ids": torch.arange(SEQ).expand(MICRO, SEQ)})
    return batches


def backward_grads(*, model_dir: str, pp: int, sp: bool, recompute: str, summed: bool = True) -> dict:
    """Canonical name -> this rank's gradient after megatron's schedule ran forward and backward of two
    micro-batches of the tiny Llama at TP2 x PP `pp` (DP fills the 4 ranks)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from toolkit import backend as backends
    from toolkit.adapters.load import canonical_parameters
    from toolkit.convert.chunks import load_model_chunks
    from toolkit.parallel.groups import Layout
    from toolkit.train.engine.tp_grads import sum_sequence_parallel_grads
    from toolkit.train.engine.loss import masked_token_loss_sum

    layout = Layout(tp=2, pp=pp, dp=4 // (2 * pp), sp=sp)
    reset_parallel_state(layout)
    backends.current().seed(SEED)
    chunks, info = load_model_chunks(checkpoint=Path(model_dir), layout=layout, params_dtype=torch.float32,
                                     recompute=recompute)
    if summed:
        sum_sequence_parallel_grads(chunks)
    vocab_size = info.settings.vocab_size
    batches = fixed_micro_batches(dp_rank=parallel_state.get_data_parallel_rank(), vocab_size=vocab_size)

    def forward_step(iterator, model):
        batch = next(iterator)
        logits = model(batch["tokens"], batch["position_ids"], None)
        return logits, lambda out: (masked_token_loss_sum(out, labels=batch["labels"], loss_mask=batch["loss_mask"])
                                    / (MICRO * SEQ), {})

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batches), model=chunks[0],
                                num_microbatches=NUM_MICRO, seq_length=SEQ, micro_batch_size=MICRO,
                                forward_only=False)
    return {name: p.grad.detach().clone() for name, p in canonical_parameters(chunks).items()}


def world_max(value: float) -> float:
    import torch.distributed as dist

    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def grad_figures(*, reference: dict, other: dict) -> dict:
    """Worst |difference| over all gradients and over the norms' gradients, and the largest gradient seen."""
    assert reference.keys() == other.keys(), sorted(set(reference) ^ set(other))
    diffs = {name: (other[name] - reference[name]).abs().max().item() for name in reference}
    norms = [name for name in reference if "layer_norm" in name or "final_layernorm" in name]
    assert norms, sorted(reference)
    return {"all": world_max(max(diffs.values())), "norms": world_max(max(diffs[n] for n in norms)),
            "largest": world_max(max(g.abs().max().item() for g in reference.values()))}


def grad_parity(plan: dict) -> dict:
    figures, references = {}, {}
    for pp, recompute in GRAD_CASES:
        references[pp, recompute] = backward_grads(model_dir=plan["model_dir"], pp=pp, sp=False, recompute=recompute)
        sequence_parallel = backward_grads(model_dir=plan["model_dir"], pp=pp, sp=True, recompute=recompute)
        figures[f"pp{pp}-{recompute}"] = grad_figures(reference=references[pp, recompute], other=sequence_parallel)
    unsummed = backward_grads(model_dir=plan["model_dir"], pp=1, sp=True, recompute="none", summed=False)
    figures["control-unsummed"] = grad_figures(reference=references[1, "none"], other=unsummed)
    return figures


def train_runs(plan: dict) -> None:
    """Each run through `toolkit.train.job.run.train`, in this process one after the other (the world group stays,
    megatron's groups are rebuilt for each layout); the control run without the engine's TP sum."""
    from megatron.core import parallel_state

    from toolkit.spec.load import load_spec
    from toolkit.train.engine import hybrid as engine
    from toolkit.check.job import job_of
    from toolkit.errors import Report
    from toolkit.train.job.run import train

    for name, spec_path in plan["runs"].items():
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        summing = engine.sum_sequence_parallel_grads
        if RUNS[name].get("unsummed"):
            engine.sum_sequence_parallel_grads = lambda chunks, **kwargs: []
        try:
            train(job=job_of(spec=load_spec(spec_path), report=Report(source=spec_path, problems=())))
        finally:
            engine.sum_sequence_parallel_grads = summing


def worker(plan_path: str) -> None:
    import torch.distributed as dist

    plan = json.loads(Path(plan_path).read_text())
    dist.init_process_group("gloo")
    figures = grad_parity(plan)
    train_runs(plan)
    if dist.get_rank() == 0:
        Path(plan["results"]).write_text(json.dumps({"grads": figures}))
    dist.barrier()


# --- the launch and what the tests check ------------------------------------------------------------------------

def write_run_spec(path: Path, *, model_dir: Path, output_dir: Path, pp=1, dp=2, zero=1, recompute="none",
                   sp=False, against=None, unsummed=False) -> Path:
    from train_helpers import write_spec

    del against, unsummed  # read from RUNS by the test and the worker
    extra = {"training": {**TRAINING, "recompute": recompute}, "parallel": {"sequence_parallel": sp}}
    if zero >= 2:
        extra["communication"] = {**SMALL_BUCKETS, **(THRESHOLD_0 if zero == 3 else {})}
    return write_spec(path, model_dir=model_dir, output_dir=output_dir, tp=2, pp=pp, dp=dp, zero=zero,
                      micro=MICRO, global_batch=MICRO * NUM_MICRO * dp, steps=STEPS, seq=SEQ, extra=extra)


@pytest.fixture(scope="module")
def launched(tiny_llama, tmp_path_factory) -> tuple[dict, Path]:
    from ranks import run_on_ranks

    root = tmp_path_factory.mktemp("sp")
    runs = {name: str(write_run_spec(root / f"{name}.yaml", model_dir=tiny_llama, output_dir=root / name, **options))
            for name, options in RUNS.items()}
    plan = {"model_dir": str(tiny_llama), "runs": runs, "results": str(root / "results.json")}
    (root / "plan.json").write_text(json.dumps(plan))
    run_on_ranks(__file__, root / "plan.json", nprocs=4, timeout=900)
    return json.loads((root / "results.json").read_text()), root


def run_figures(root: Path, name: str) -> dict:
    """Worst per-step |Δloss| and |Δgrad norm| and worst |Δweight| in the export, run `name` against its
    reference run."""
    from safetensors.torch import load_file

    from train_helpers import read_metrics

    reference = RUNS[name]["against"]
    a, b = read_metrics(root / reference), read_metrics(root / name)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
    assert all(r["grad_norm"] > TRAINING["grad_clip"] for r in a), a  # clipping acted on every step
    wa = load_file(root / reference / "final-hf" / "model.safetensors")
    wb = load_file(root / name / "final-hf" / "model.safetensors")
    assert wa.keys() == wb.keys()
    return {"loss": max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b)),
            "grad_norm": max(abs(x["grad_norm"] - y["grad_norm"]) for x, y in zip(a, b)),
            "weight": max((wa[k] - wb[k]).abs().max().item() for k in wa),
            "losses": [round(r["loss"], 6) for r in b]}


@pytest.mark.multiproc
@pytest.mark.parametrize("case", [f"pp{pp}-{recompute}" for pp, recompute in GRAD_CASES])
def test_sp_gradients_equal_tp_gradients(case, launched):
    figures = launched[0]["grads"][case]
    print(f"\n{case}: max |Δgrad| all {figures['all']:.2e}, norms {figures['norms']:.2e} "
          f"(largest gradient {figures['largest']:.2e})")
    assert figures["all"] < GRAD_TOLERANCE and figures["norms"] < GRAD_TOLERANCE


@pytest.mark.multiproc
def test_sp_gradients_without_the_tp_sum_differ(launched):
    """The control: without the engine's hooks the norms' gradients are each rank's partial sum."""
    figures = launched[0]["grads"]["control-unsummed"]
    print(f"\nunsummed: max |Δgrad| norms {figures['norms']:.2e}")
    assert figures["norms"] > CONTROL_MINIMUM


@pytest.mark.multiproc
@pytest.mark.parametrize("name", [name for name, options in RUNS.items()
                                  if options.get("against") and not options.get("unsummed")])
def test_sp_trains_like_tp(name, launched):
    figures = run_figures(launched[1], name)
    print(f"\n{name}: max |Δloss| {figures['loss']:.2e}, |Δgrad_norm| {figures['grad_norm']:.2e}, "
          f"|Δweight| {figures['weight']:.2e}; losses {figures['losses']}")
    assert figures["loss"] < LOSS_TOLERANCE
    assert figures["grad_norm"] < GRAD_NORM_TOLERANCE
    assert figures["weight"] < WEIGHT_TOLERANCE


@pytest.mark.multiproc
def test_training_without_the_tp_sum_is_caught(launched):
    figures = run_figures(launched[1], "tp2-dp2-zero2-selective-sp-unsummed")
    print(f"\nunsummed training: |Δgrad_norm| {figures['grad_norm']:.2e}, |Δweight| {figures['weight']:.2e}")
    assert figures["grad_norm"] > CONTROL_MINIMUM or figures["weight"] > CONTROL_MINIMUM


# --- what must hold on GPU, checked here: Transformer Engine's spec and its marked parameters ---------------------

def backend_with(monkeypatch, *, transformer_engine: bool):
    from toolkit import backend as backends

    backend = backends.Backend(name="cuda" if transformer_engine else "cpu", dist_backend="gloo",
                               use_transformer_engine=transformer_engine)
    monkeypatch.setattr(backends, "current", lambda: backend)
    return backend


@pytest.mark.parametrize("transformer_engine", [False, True], ids=["local", "transformer-engine"])
@pytest.mark.parametrize("sp", [False, True])
def test_the_model_config_carries_sequence_parallel_on_both_layer_kinds(transformer_engine, sp, monkeypatch):
    from toolkit.adapters.build import transformer_config
    from toolkit.adapters.hf_config import model_settings
    from toolkit.parallel.groups import Layout
    from toolkit.models.tiny import tiny_config

    backend_with(monkeypatch, transformer_engine=transformer_engine)
    config = transformer_config(settings=model_settings(tiny_config("llama")), layout=Layout(tp=2, dp=2, sp=sp),
                                params_dtype=torch.float32)
    assert config.sequence_parallel is sp and config.tensor_model_parallel_size == 2


def test_transformer_engine_layers_keep_megatrons_norms(monkeypatch):
    """With TE, the layer norms live inside TE's fused linears and the final norm is megatron's TENorm: both take
    `config.sequence_parallel` and mark their weights themselves. dsmt must not swap in its torch norm there."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    from toolkit.adapters.build import decoder_spec, layer_spec

    # TE's layer spec has no separate input norm (it is TELayerNormColumnParallelLinear's layer_norm_weight).
    te_spec = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(input_layernorm=IdentityOp))
    asked = []
    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec",
                        lambda **kwargs: asked.append(kwargs) or te_spec)
    backend_with(monkeypatch, transformer_engine=True)
    assert layer_spec() is te_spec and asked == [{"qk_layernorm": False}]
    assert layer_spec(qk_norm=True) is te_spec and asked[-1] == {"qk_layernorm": True}  # Qwen3's head norms
    assert decoder_spec(config=None, layer_spec=te_spec, vp_stage=None) is te_spec  # megatron picks TENorm
    # MoE: TE's separate MLP norm is keyed as the local layers key it, so one checkpoint serves both
    moe = layer_spec(num_experts=4)
    assert asked[-1] == {"qk_layernorm": False, "num_experts": 4, "moe_grouped_gemm": False}
    assert moe.submodules.sharded_state_dict_keys_map == {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def test_local_layers_and_final_norm_use_the_marked_torch_norm(monkeypatch):
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from toolkit.adapters.build import decoder_spec, layer_spec, transformer_config
    from toolkit.adapters.family import AdapterError
    from toolkit.adapters.hf_config import model_settings
    from toolkit.adapters.norms import TorchNorm
    from toolkit.parallel.groups import Layout
    from toolkit.models.tiny import tiny_config

    backend_with(monkeypatch, transformer_engine=False)
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda *a, **k: 0)
    settings = model_settings(tiny_config("llama"))
    config = transformer_config(settings=settings, layout=Layout(tp=2, pp=2, sp=True), params_dtype=torch.float32)
    spec = layer_spec()
    assert spec.submodules.input_layernorm is TorchNorm and spec.submodules.pre_mlp_layernorm is TorchNorm
    block = decoder_spec(config=config, layer_spec=spec, vp_stage=None)
    assert isinstance(block, TransformerBlockSubmodules) and block.layer_norm is TorchNorm
    assert len(block.layer_specs) == settings.num_layers // 2
    norm = TorchNorm(config, hidden_size=8, eps=1e-6)
    assert type(norm) is torch.nn.RMSNorm and norm.weight.sequence_parallel is True
    # Gemma's (1 + w) norm: megatron's zero-centred gamma, as Transformer Engine computes it
    centred = TorchNorm(dataclasses.replace(config, layernorm_zero_centered_gamma=True), hidden_size=8, eps=1e-6)
    with torch.no_grad():
        centred.weight.copy_(torch.randn(8))
    x = torch.randn(3, 8)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + centred.weight)
    torch.testing.assert_close(centred(x), expected, rtol=0, atol=1e-6)
    assert centred.weight.sequence_parallel is True
    with pytest.raises(AdapterError, match="normalization=ScaleNorm"):
        TorchNorm(dataclasses.replace(config, normalization="ScaleNorm"), hidden_size=8)


class TransformerEngineLike(torch.nn.Module):
    """The parameters of a TE layer as TE marks them under SP: TELayerNormColumnParallelLinear
    (`layer_norm_weight` / `layer_norm_bias` sequence_parallel, `weight` TP-split), a row-parallel linear's bias
    (sequence_parallel) and TENorm's weight."""

    def __init__(self, *, sp: bool):
        super().__init__()
        self.config = types.SimpleNamespace(sequence_parallel=sp)
        for name in ("layer_norm_weight", "layer_norm_bias", "weight", "row_bias", "final_norm_weight"):
            self.register_parameter(name, torch.nn.Parameter(torch.ones(4)))
        for name in ("layer_norm_weight", "layer_norm_bias", "row_bias", "final_norm_weight"):
            getattr(self, name).sequence_parallel = sp  # TE sets it False too when SP is off
        self.weight.tensor_model_parallel = True


def test_the_engine_sums_what_transformer_engine_marks():
    from toolkit.train.engine.tp_grads import sequence_parallel_params

    chunk = TransformerEngineLike(sp=True)
    found = {id(p) for p in sequence_parallel_params([chunk])}
    assert found == {id(chunk.layer_norm_weight), id(chunk.layer_norm_bias), id(chunk.row_bias),
                     id(chunk.final_norm_weight)}
    assert sequence_parallel_params([TransformerEngineLike(sp=False)]) == []


def test_a_sequence_not_divisible_by_tp_is_refused(monkeypatch):
    from megatron.core import parallel_state

    from toolkit.errors import DsmtError
    from toolkit.train.engine.step_inputs import check_sequence_split

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 2)
    check_sequence_split(seq_length=31, chunks=[TransformerEngineLike(sp=False)])
    check_sequence_split(seq_length=32, chunks=[TransformerEngineLike(sp=True)])
    with pytest.raises(DsmtError, match="seq_length=31 is not divisible by tp=2"):
        check_sequence_split(seq_length=31, chunks=[TransformerEngineLike(sp=True)])


if __name__ == "__main__":
    worker(sys.argv[1])
