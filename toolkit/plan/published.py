"""Published large-scale training runs: the layouts experts chose and the utilisation they measured.

The planner's time model is calibrated against the `utilisation` rows (tests/plan/test_published.py) and its
search is checked against the layouts (tests/plan/test_expert_layouts.py). Every row names its source; figures
are copied from the source, never derived, except where a note says how.

Sources
  NARAYANAN  Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
             Megatron-LM" (SC21), Table 1: GPT models 1.7B-1T on DGX A100 80 GB (Selene), seq 2048, vocab
             51,200; achieved TFLOP/s per GPU counted with full activation recompute (their eq. 3).
  MT_NLG     Smith et al. 2022, "Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B", section 2:
             280 DGX A100 nodes, 8-way tensor x 35-way pipeline x 8-way data parallel, batch 1920, seq 2048.
  NEOX       Black et al. 2022, "GPT-NeoX-20B", section 3: 96 A100-SXM4-40GB, tensor 2, pipeline 4, ZeRO-1;
             batch from the released config (micro-batch 4 x 32 accumulation x 12 replicas = 1536).
  NEMO_2412  NVIDIA NeMo Framework 24.12 performance summary (docs.nvidia.com/nemo-framework/user-guide/24.12/
             nemotoolkit/performance/performance_summary.html): pre-training on DGX-H100, FP8.
  LLAMA3     Dubey et al. 2024, "The Llama 3 Herd of Models", Table 4: 405B on H100, BF16 MFU.
  MEGASCALE  Jiang et al. 2024, "MegaScale" (NSDI'24), abstract and section 6: 175B on 12,288 GPUs, 55.2% MFU.
"""

from __future__ import annotations

import dataclasses

from toolkit.errors import DsmtError
from toolkit.plan.assumptions import Assumptions
from toolkit.plan.published_run import PublishedRun, gpt_shape
from toolkit.plan.published_sharded import SHARDED_RUNS, SHARDED_SHAPES
from toolkit.plan.timing import estimate_step_time
from toolkit.models.shapes import BUILTIN_SHAPES, ModelShape

NARAYANAN = "Narayanan et al. 2021, Table 1"
MT_NLG = "Smith et al. 2022 (MT-NLG 530B), section 2"
NEOX = "Black et al. 2022 (GPT-NeoX-20B), section 3 and released config"
NEMO_2412 = "NVIDIA NeMo 24.12 performance summary, DGX-H100 pre-training"
LLAMA3 = "Dubey et al. 2024 (Llama 3), Table 4"
MEGASCALE = "Jiang et al. 2024 (MegaScale), abstract and section 6"


# Shapes published only in these sources (the named models are in toolkit/models/shapes.py).
PAPER_SHAPES: dict[str, ModelShape] = {**SHARDED_SHAPES, **{s.name: s for s in [
    gpt_shape("gpt-1.7b", 2304, 24, 24), gpt_shape("gpt-3.6b", 3072, 30, 32), gpt_shape("gpt-7.5b", 4096, 36, 32),
    gpt_shape("gpt-18.4b", 6144, 40, 48), gpt_shape("gpt-39.1b", 8192, 48, 64), gpt_shape("gpt-76.1b", 10240, 60, 80),
    gpt_shape("gpt-145.6b", 12288, 80, 96), gpt_shape("gpt-310.1b", 16384, 96, 128),
    gpt_shape("mt-nlg-530b", 20480, 105, 128),              # Narayanan's 529.6B row is the same shape
    # NeMo's GPT-3 configs (conf/training/gpt3/5b.yaml, 20b.yaml), GPT-2 BPE vocabulary.
    gpt_shape("nemo-gpt3-5b", 4096, 24, 32, vocab=50257), gpt_shape("nemo-gpt3-20b", 6144, 44, 48, vocab=50257),
    # GPT-NeoX-20B config.json: 44 layers, 6144 hidden, 64 heads, ffn 4h, untied, vocab 50432.
    ModelShape("gpt-neox-20b", 6144, 44, 64, 64, 24576, 50432, False, False, 2048),
    # Nemotron-4 340B (Nvidia 2024 report, Table 1): squared-ReLU MLP (not gated), GQA 8 groups, untied.
    ModelShape("nemotron4-340b", 18432, 96, 96, 8, 73728, 256000, False, False, 4096),
]}}


def model_shape(name: str) -> ModelShape:
    """A published run's model: a built-in shape or one of PAPER_SHAPES."""
    shape = BUILTIN_SHAPES.get(name) or PAPER_SHAPES.get(name)
    if shape is None:
        raise DsmtError(f"no shape called {name!r}; known: {', '.join(sorted({**BUILTIN_SHAPES, **PAPER_SHAPES}))}")
    return shape


def _narayanan(model, gpus, batch, tp, pp, tflops) -> PublishedRun:
    # utilisation = achieved TFLOP/s / 312 (A100 bf16 peak), the paper's own "% of peak" column
    return PublishedRun(source=NARAYANAN, model=model, gpu="a100-80gb", num_gpus=gpus, global_batch=batch,
                        seq_length=2048, tp=tp, pp=pp, recompute="full", utilisation=tflops / 312.0,
                        utilisation_kind="hfu", precision="mixed", zero_stage=0, sequence_parallel=False,
                        attention="local", dropout=True)


RUNS: tuple[PublishedRun, ...] = (
    _narayanan("gpt-1.7b", 32, 512, 1, 1, 137), _narayanan("gpt-3.6b", 64, 512, 2, 1, 138),
    _narayanan("gpt-7.5b", 128, 512, 4, 1, 142), _narayanan("gpt-18.4b", 256, 1024, 8, 1, 135),
    _narayanan("gpt-39.1b", 512, 1536, 8, 2, 138), _narayanan("gpt-76.1b", 1024, 1792, 8, 4, 140),
    _narayanan("gpt-145.6b", 1536, 2304, 8, 8, 148), _narayanan("gpt-310.1b", 1920, 2160, 8, 16, 155),
    _narayanan("mt-nlg-530b", 2520, 2520, 8, 35, 163), _narayanan("gpt-1t", 3072, 3072, 8, 64, 163),
    PublishedRun(source=MT_NLG, model="mt-nlg-530b", gpu="a100-80gb", num_gpus=2240, global_batch=1920,
                 seq_length=2048, tp=8, pp=35, recompute="full", zero_stage=None, sequence_parallel=False),
    PublishedRun(source=NEOX, model="gpt-neox-20b", gpu="a100-40gb", num_gpus=96, global_batch=1536,
                 seq_length=2048, tp=2, pp=4, micro_batch_size=4, engine="deepspeed"),
    PublishedRun(source=NEMO_2412, model="nemo-gpt3-5b", gpu="h100-80gb", num_gpus=64, global_batch=2048,
                 seq_length=2048, tp=1, pp=1, micro_batch_size=4, precision="fp8"),
    PublishedRun(source=NEMO_2412, model="nemo-gpt3-20b", gpu="h100-80gb", num_gpus=64, global_batch=256,
                 seq_length=2048, tp=2, pp=1, micro_batch_size=2, precision="fp8"),
    PublishedRun(source=NEMO_2412, model="gpt3-175b", gpu="h100-80gb", num_gpus=128, global_batch=256,
                 seq_length=2048, tp=4, pp=8, vpp=6, precision="fp8"),
    PublishedRun(source=NEMO_2412, model="gpt3-175b", gpu="h100-80gb", num_gpus=512, global_batch=2048,
                 seq_length=2048, tp=4, pp=8, vpp=6, micro_batch_size=2, precision="fp8"),
    PublishedRun(source=NEMO_2412, model="llama2-7b", gpu="h100-80gb", num_gpus=8, global_batch=128,
                 seq_length=4096, tp=1, pp=1, precision="fp8"),
    PublishedRun(source=NEMO_2412, model="llama2-13b", gpu="h100-80gb", num_gpus=16, global_batch=128,
                 seq_length=4096, tp=1, pp=4, vpp=10, precision="fp8"),
    PublishedRun(source=NEMO_2412, model="llama2-70b", gpu="h100-80gb", num_gpus=64, global_batch=128,
                 seq_length=4096, tp=4, pp=4, vpp=20, precision="fp8"),
    PublishedRun(source=NEMO_2412, model="llama3-8b", gpu="h100-80gb", num_gpus=8, global_batch=128,
                 seq_length=8192, tp=1, pp=1, cp=2, precision="fp8"),
    PublishedRun(source=NEMO_2412, model="llama3-70b", gpu="h100-80gb", num_gpus=64, global_batch=128,
                 seq_length=8192, tp=4, pp=4, cp=2, vpp=5, precision="fp8"),
    PublishedRun(source=NEMO_2412, model="nemotron4-340b", gpu="h100-80gb", num_gpus=128, global_batch=32,
                 seq_length=4096, tp=8, pp=8, vpp=12, precision="fp8"),
    # Llama 3 405B: 126 layers in 16 stages (the first and last hold one layer fewer) under an interleaved
    # schedule whose virtual-stage count section 3.3.2 does not give. Batch = DP x batch size per DP (Table 4).
    PublishedRun(source=LLAMA3, model="llama3-405b", gpu="h100-80gb", num_gpus=8192, global_batch=2048,
                 seq_length=8192, tp=8, pp=16, utilisation=0.43, interleaved_unpublished=True),
    PublishedRun(source=LLAMA3, model="llama3-405b", gpu="h100-80gb", num_gpus=16384, global_batch=2048,
                 seq_length=8192, tp=8, pp=16, utilisation=0.41, interleaved_unpublished=True),
    # MegaScale's own 55.2% MFU rests on changes dsmt does not run (parallel transformer block, sliding-window
    # attention, LAMB, overlapped DP and PP traffic); the Megatron-LM baseline on the same job is 55.2 / 1.34.
    PublishedRun(source=MEGASCALE, model="gpt3-175b", gpu="a100-80gb", num_gpus=12288, global_batch=6144,
                 seq_length=2048, tp=8, pp=8, utilisation=round(0.552 / 1.34, 3),
                 note="Megatron-LM baseline, derived: 55.2% / 1.34"),
    *SHARDED_RUNS,
)


def calibration_runs() -> list[PublishedRun]:
    """Runs with a measured utilisation of the bf16 peak."""
    return [r for r in RUNS if r.utilisation is not None]


def expressible(run: PublishedRun) -> bool:
    """The planner can propose the run's layout: its stages hold equal layer counts (megatron-core's split)."""
    return model_shape(run.model).num_layers % (run.pp * run.vpp) == 0


def expert_runs() -> list[PublishedRun]:
    """The layouts the planner's choice is compared with: tensor / pipeline runs with ZeRO-0/1 (TP and PP were the
    authors' choice; ZeRO-3 / FSDP runs had neither) whose stages hold equal layer counts and whose sharding the
    source states."""
    return [r for r in RUNS if r.engine != "fsdp" and r.zero_stage in (0, 1) and expressible(r)]


def premise(run: PublishedRun):
    """The question the run answered, as search limits: its sharding (a replicated optimizer is ZeRO-0) and its
    recompute choice where the source states it; TP, PP, virtual stages and micro-batch free."""
    from toolkit.plan.search import SearchLimits

    limits = SearchLimits(zero_stages=(run.layout().zero_stage,))
    return dataclasses.replace(limits, recompute=(run.recompute,)) if run.recompute else limits


def run_assumptions(run: PublishedRun, assumptions: Assumptions) -> Assumptions:
    """The planner's assumptions with the run's own setup: its attention kernel and dropout (Megatron-LM in 2021
    trained GPT with dropout 0.1 and an unfused softmax), gradient reduction width and data-parallel engine."""
    return dataclasses.replace(assumptions, attention=run.attention, dropout=run.dropout,
                               dp_grad_comm_bytes=run.grad_comm_bytes, dp_engine=run.engine)


def predicted_utilisation(run: PublishedRun, *, assumptions: Assumptions, vpp: int | None = None) -> float:
    """The time model's utilisation of the run's own layout, of the kind the source measured (MFU or HFU)."""
    layout = run.layout() if vpp is None else dataclasses.replace(run.layout(), vpp=vpp)
    t = estimate_step_time(shape=model_shape(run.model), layout=layout, training=run.training(),
                           cluster=run.cluster(), assumptions=run_assumptions(run, assumptions))
    return t.hfu if run.utilisation_kind == "hfu" else t.mfu


def planner_plan(run: PublishedRun, *, assumptions: Assumptions | None = None):
    """The planner's answer (a search.Plan) to the run's question: its model, GPUs, global batch and sequence
    length under its premise and its own setup (run_assumptions)."""
    from toolkit.plan.search import plan  # search imports timing; imported here to keep this module data-first

    return plan(shape=model_shape(run.model), training=run.training(), cluster=run.cluster(),
                assumptions=run_assumptions(run, assumptions or Assumptions()), limits=premise(run))
