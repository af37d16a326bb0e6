"""ds_config.json: batch arithmetic derived from the layout, every value resolved (no "auto")."""

from __future__ import annotations

from toolkit.spec.layout import RunLayout
from toolkit.spec.schema import JobSpec, WandbSpec



def build_deepspeed_config(*, spec: JobSpec, layout: RunLayout) -> dict:
    training = spec.training
    config = {
        # DeepSpeed's data-parallel group is dp × cp (toolkit/parallel/mpu.py: the CP ranks of a replica reduce their
        # gradients together) and it asserts train_batch_size = micro × accumulation × its group size, so each CP
        # rank counts the replica's micro-batches once: global_batch_size × cp (= the global batch when cp = 1).
        "train_batch_size": layout.global_batch_size * layout.cp,
        "train_micro_batch_size_per_gpu": layout.micro_batch_size,
        "gradient_accumulation_steps": layout.grad_accum_steps,
        # off: DeepSpeed's own "step=..., skipped=..., lr=..." lines would repeat dsmt's step line (every
        # training.log_interval steps, rank 0)
        "steps_per_print": None,
        "gradient_clipping": training.grad_clip,
        "zero_optimization": _zero_section(spec=spec),
        "bf16": _bf16_section(enabled=training.precision == "bf16"),
        "fp16": _fp16_section(enabled=training.precision == "fp16"),
        "data_types": {"grad_accum_dtype": grad_accum_dtype(spec=spec)},
        "optimizer": _optimizer_section(spec=spec),
        # no "scheduler": dsmt's engines hand deepspeed.initialize transformers' schedule built from the spec
        # (toolkit/spec/lr_schedule.py: DeepSpeed's own run steps 1 and 2 at lr 0)
        # megatron's default: gradients are reduced over data parallelism in fp32 whatever the training precision
        "communication_data_type": spec.communication.communication_data_type or "fp32",
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "tensorboard": {"enabled": training.tensorboard, "output_path": f"{training.output_dir}/tensorboard",
                        "job_name": spec.cluster.job_name},
        "csv_monitor": {"enabled": True, "output_path": f"{training.output_dir}/monitor", "job_name": spec.cluster.job_name},
    }
    if training.wandb is not None:  # absent otherwise: DeepSpeed's default is off
        config["wandb"] = _wandb_section(wandb=training.wandb)
    if spec.parallel.offload_optimizer or spec.parallel.offload_params:
        config["zero_force_ds_cpu_optimizer"] = True  # offload needs DeepSpeed's CPU Adam, not a client optimizer
    return config


def _wandb_section(*, wandb: WandbSpec) -> dict:
    """DeepSpeed's WandbConfig keys (deepspeed/monitor/config.py); W&B's entity is DeepSpeed's `team`. Its
    `wandb.init(project, group, entity)` on global rank 0 takes no run name: `wandb.name` reaches W&B as WANDB_NAME
    (toolkit/train/job/run.py `start_process_groups`)."""
    return {"enabled": True, "project": wandb.project, "team": wandb.entity, "group": wandb.group}


def _zero_section(*, spec: JobSpec) -> dict:
    stage, comm = spec.parallel.zero_stage, spec.communication
    section = {"stage": stage}
    if stage == 0:
        return section
    section.update({
        # what runs: at pp > 1 the engine reduces after megatron's schedule, and DeepSpeed allows no overlap there
        "overlap_comm": comm.overlap_comm and spec.parallel.pp == 1,
        "contiguous_gradients": comm.contiguous_gradients,
        "reduce_scatter": comm.reduce_scatter,
        "reduce_bucket_size": comm.reduce_bucket_elements,
    })
    if stage < 3:
        section["allgather_bucket_size"] = comm.allgather_bucket_elements
    else:
        section["stage3_prefetch_bucket_size"] = comm.prefetch_bucket_elements
        section["stage3_param_persistence_threshold"] = comm.param_persistence_threshold_elements
    if spec.parallel.offload_optimizer:
        section["offload_optimizer"] = {"device": "cpu", "pin_memory": spec.cluster.device == "cuda"}
    if spec.parallel.offload_params:
        section["offload_param"] = {"device": "cpu", "pin_memory": spec.cluster.device == "cuda"}
    return section


def grad_accum_dtype(*, spec: JobSpec) -> str:
    """The dtype gradients accumulate in across micro-batches: fp32 (megatron's default) unless the spec says."""
    if spec.training.precision == "fp32":
        return "fp32"
    return spec.communication.grad_accum_dtype or "fp32"


def _bf16_section(*, enabled: bool) -> dict:
    if not enabled:
        return {"enabled": False}
    # With fp32 accumulation DeepSpeed's BF16 optimizer (ZeRO-1) moves each bf16 gradient into its fp32 buffer
    # as soon as backward produces it; otherwise megatron's pipeline schedule, which runs backward itself, would
    # accumulate the micro-batches in bf16 before DeepSpeed sees them.
    return {"enabled": True, "immediate_grad_update": True}


def _fp16_section(*, enabled: bool) -> dict:
    if not enabled:
        return {"enabled": False}
    # Dynamic loss scaling (loss_scale 0) starting at 2^16, DeepSpeed's documented defaults written out.
    return {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
            "hysteresis": 2, "min_loss_scale": 1}


def _optimizer_section(*, spec: JobSpec) -> dict:
    training = spec.training
    params = {"lr": training.lr, "betas": [training.adam_beta1, training.adam_beta2], "eps": training.adam_eps,
              "weight_decay": training.weight_decay}
    if spec.cluster.device == "cpu" and not spec.parallel.offload_optimizer:
        params["torch_adam"] = True  # skip building FusedAdam (a ~60 s JIT op) on CPU
    return {"type": "AdamW", "params": params}
