"""Typed sections of a job spec. Each section validates itself; checks across sections live in `checks.py`.

Rules that a single section can decide are raised as `PydanticCustomError(rule, message)`, so the rule name
(`model_source`, `host_name`, ...) survives into the report. Every field has a default except the model, so the
five-section spec the planner emits is complete.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from toolkit.spec.data_schema import DATA_RULES, DATA_SOURCE_FIX, DataSpec, MixSource  # noqa: F401  (part of the schema)
from toolkit.spec.preference import PREFERENCE_RULES, DpoSpec, OrpoSpec, SimpoSpec, check_method
from toolkit.spec.sections import FloatType, Section, _safe_path

# RFC 1123 host names (and IPv4 addresses): letters, digits, '-', '.'; nothing a shell would interpret.
HOST_NAME_RE = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")
INTERFACE_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,15}(,[A-Za-z0-9_.:-]{1,15})*$")  # NCCL_SOCKET_IFNAME allows a list
ENV_NAME_RE = re.compile(r"^[A-Z][A-Z0-9_]{0,63}$")
ENV_VALUE_RE = re.compile(r"^[A-Za-z0-9_.,:/=^+-]{0,256}$")  # .deepspeed_env is exported unquoted by pdsh
JOB_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# sbatch --time: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS (or UNLIMITED / INFINITE).
SLURM_TIME_RE = re.compile(r"^(?:\d+(?::[0-5]?\d){0,2}|\d+-\d{1,2}(?::[0-5]?\d){0,2}|UNLIMITED|INFINITE)$")

# GPU presets the spec accepts (memory in GiB; the planner owns the performance figures).
GPU_MEMORY_GIB: dict[str, float | None] = {
    "h100-80gb": 80, "h200-141gb": 141, "a100-80gb": 80, "a100-40gb": 40, "cpu": None,
}


# Rules a section decides by itself (the `PydanticCustomError` types raised below; a test keeps this list whole).
SCHEMA_RULES = frozenset({
    "bad_path", "batch_both", "batch_tokens_vs_seq", "duplicate_host", "env_name",
    "env_value", "gpu_device_mismatch", "host_name", "hosts_count", "hosts_required",
    "job_name", "lora_export", "lora_rank", "sbatch_option", "slurm_line", "slurm_time", "slurm_value", "min_lr_above_lr",
    "model_source", "network_interface", "offload_optimizer_needs_zero", "offload_params_needs_zero3", "unknown_gpu",
    "wandb_value", "warmup_vs_steps",
}) | DATA_RULES | PREFERENCE_RULES


class ModelSpec(Section):
    path: str | None = None  # HF checkpoint directory or config.json
    builtin: str | None = None  # a name in toolkit.models.shapes.BUILTIN_SHAPES
    config: dict[str, Any] | None = None  # inline HF config dict (a tiny Llama for CPU)
    make_vocab_size_divisible_by: int = Field(128, ge=1)  # vocab padded to a multiple of this (not × tp: see toolkit/models/shapes.py)

    @field_validator("path")
    @classmethod
    def _path_ok(cls, value):
        return _safe_path(value, what="model.path")

    @model_validator(mode="after")
    def _exactly_one_source(self):
        given = [k for k in ("path", "builtin", "config") if getattr(self, k) is not None]
        if len(given) != 1:
            raise PydanticCustomError(
                "model_source", "model needs exactly one of path, builtin, config; got {given}",
                {"given": ", ".join(given) or "none"},
            )
        return self


class SlurmSpec(Section):
    """Site settings for job.sbatch. Values are shell-quoted there (sbatch parses #SBATCH lines with the same
    quotes, so `--account='a b'` stays one option); `setup` lines run verbatim before srun."""

    account: str | None = None
    partition: str | None = None
    time: str | None = None  # walltime in SLURM's format, e.g. 30, 4:00:00, 2-12:00:00
    qos: str | None = None
    # CPU cores for each node's one task (torchrun and all its ranks). Without it SLURM gives the task one core and
    # every rank's host side shares it. None: 8 per GPU rank (dataloader and host work; most GPU nodes have more),
    # or one per rank on CPU runs. Set your nodes' count when they have fewer cores.
    cpus_per_task: int | None = Field(default=None, ge=1)
    extra_sbatch: list[str] = Field(default_factory=list)  # more #SBATCH options: --exclusive, --constraint=a100
    setup: list[str] = Field(default_factory=list)  # shell lines before srun: module load cuda/12.4, source venv
    srun_args: list[str] = Field(default_factory=list)  # srun words before torchrun: --container-image=...

    @field_validator("account", "partition", "qos")
    @classmethod
    def _value_safe(cls, value, info):
        if value is not None and (not value.strip() or not _sbatch_carries(value)):
            raise PydanticCustomError(
                "slurm_value", "cluster.slurm.{field}={value} must be a non-empty single line without control "
                "characters or '\\' (an #SBATCH line cannot carry them)", {"field": info.field_name, "value": repr(value)})
        return value

    @field_validator("time")
    @classmethod
    def _time_format(cls, value):
        if value is not None and not SLURM_TIME_RE.match(value):
            raise PydanticCustomError(
                "slurm_time", "cluster.slurm.time={value} is not a SLURM time; use MM, MM:SS, HH:MM:SS, D-HH, "
                "D-HH:MM or D-HH:MM:SS (e.g. 4:00:00, 2-12:00:00)", {"value": repr(value)})
        return value

    @field_validator("extra_sbatch")
    @classmethod
    def _options_safe(cls, value):
        for option in value:
            owner = SBATCH_OWNED.get(option.split("=", 1)[0])
            if not option.startswith("-") or not _sbatch_carries(option) or owner:
                fix = (f"set {owner} instead" if owner else "give one sbatch option per item, starting with '-', "
                       "with no control characters or '\\', e.g. --exclusive or --constraint=a100")
                raise PydanticCustomError("sbatch_option", "cluster.slurm.extra_sbatch item {option}: {fix}",
                                          {"option": repr(option), "fix": fix})
        return value

    @field_validator("setup", "srun_args")
    @classmethod
    def _lines_safe(cls, value, info):
        for line in value:
            if not line.strip() or any(ch in line for ch in "\n\r\0"):
                raise PydanticCustomError(
                    "slurm_line", "cluster.slurm.{field} item {line} must be non-empty with no newline or NUL; "
                    "give one item per line / word", {"field": info.field_name, "line": repr(line)})
        return value


def _sbatch_carries(value: str) -> bool:
    """Whether an #SBATCH line carries `value` intact once quoted: sbatch's directive parser honours quotes, but a
    backslash escapes the next character even inside them, and a line ends at a newline."""
    return "\\" not in value and not any(ord(ch) < 32 or ord(ch) == 127 for ch in value)


# sbatch options the spec already decides: an extra_sbatch copy would silently override them.
SBATCH_OWNED = {
    "--job-name": "cluster.job_name", "-J": "cluster.job_name", "--nodes": "cluster.nodes", "-N": "cluster.nodes",
    "--ntasks-per-node": "cluster.gpus_per_node (job.sbatch runs one torchrun task per node)",
    "--gpus-per-node": "cluster.gpus_per_node",
    "--account": "cluster.slurm.account", "-A": "cluster.slurm.account", "--partition": "cluster.slurm.partition",
    "-p": "cluster.slurm.partition", "--time": "cluster.slurm.time", "-t": "cluster.slurm.time",
    "--qos": "cluster.slurm.qos", "-q": "cluster.slurm.qos",
    "--cpus-per-task": "cluster.slurm.cpus_per_task", "-c": "cluster.slurm.cpus_per_task",
    "--signal": "training.preemption_grace_s (job.sbatch asks for SIGTERM that many seconds before the time limit)",
}


class ClusterSpec(Section):
    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(8, ge=1)  # processes per node (CPU: ranks per machine)
    gpu: str = "h100-80gb"
    hosts: list[str] | Literal["slurm"] | None = None  # None: ["localhost"] on one node
    master_addr: str | None = None  # None: the first host (127.0.0.1 for localhost)
    master_port: int = Field(29500, ge=1024, le=65535)
    network_interface: str | None = None  # NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME
    interconnect: Literal["infiniband", "roce", "tcp"] = "infiniband"
    launcher: Literal["pdsh", "openmpi", "no_ssh"] = "pdsh"
    device: Literal["cuda", "cpu"] = "cuda"
    job_name: str = "dsmt"
    slurm: SlurmSpec = Field(default_factory=SlurmSpec)  # account, partition, time, ... for job.sbatch

    @field_validator("gpu")
    @classmethod
    def _gpu_known(cls, value):
        if value not in GPU_MEMORY_GIB:
            raise PydanticCustomError(
                "unknown_gpu", "gpu={value} is not a preset; valid: {valid}",
                {"value": repr(value), "valid": ", ".join(GPU_MEMORY_GIB)},
            )
        return value

    @field_validator("hosts")
    @classmethod
    def _hosts_safe(cls, value):
        if isinstance(value, list):
            for host in value:
                _check_host(host)
            if len(set(value)) != len(value):
                raise PydanticCustomError("duplicate_host", "hosts lists a name twice: {hosts}", {"hosts": value})
        return value

    @field_validator("master_addr")
    @classmethod
    def _addr_safe(cls, value):
        return value if value is None else _check_host(value)

    @field_validator("network_interface")
    @classmethod
    def _iface_safe(cls, value):
        if value is not None and not INTERFACE_RE.match(value):
            raise PydanticCustomError(
                "network_interface", "network_interface={value} is not an interface name like eth0, ib0, ens5f0",
                {"value": repr(value)},
            )
        return value

    @field_validator("job_name")
    @classmethod
    def _job_name_safe(cls, value):
        if not JOB_NAME_RE.match(value):
            raise PydanticCustomError("job_name", "job_name={value}: use letters, digits, '_', '.', '-'", {"value": repr(value)})
        return value

    @model_validator(mode="after")
    def _hosts_match_nodes(self):
        if self.device == "cpu" and self.gpu != "cpu":
            raise PydanticCustomError("gpu_device_mismatch", "device=cpu needs gpu=cpu (got gpu={gpu})", {"gpu": repr(self.gpu)})
        if self.device == "cuda" and self.gpu == "cpu":
            raise PydanticCustomError("gpu_device_mismatch", "gpu=cpu needs device=cpu (got device=cuda)", {})
        if self.hosts is None and self.nodes > 1:
            raise PydanticCustomError(
                "hosts_required", "nodes={nodes} needs hosts: a list of {nodes} host names, or 'slurm'", {"nodes": self.nodes}
            )
        if isinstance(self.hosts, list) and len(self.hosts) != self.nodes:
            raise PydanticCustomError(
                "hosts_count", "nodes={nodes} but hosts lists {count}: {hosts}; set nodes={count} or list {nodes} hosts",
                {"nodes": self.nodes, "count": len(self.hosts), "hosts": self.hosts},
            )
        return self


def _check_host(host: str) -> str:
    if not isinstance(host, str) or not HOST_NAME_RE.match(host):
        raise PydanticCustomError(
            "host_name", "host {host} is not a valid host name (letters, digits, '-', '.')", {"host": repr(host)}
        )
    return host


class ParallelSpec(Section):
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    vpp: int | None = Field(None, ge=1)  # virtual pipeline stages per rank (interleaved 1F1B); None: not interleaved
    cp: int = Field(1, ge=1)  # context parallel: the sequence split over cp ranks (needs fused attention, GPU)
    ep: int = Field(1, ge=1)  # expert parallel (MoE models): the experts split over ep of the data-parallel ranks
    sequence_parallel: bool = False  # with tp > 1: norm / dropout activations split over the TP ranks
    zero_stage: Literal[0, 1, 2, 3] = 1
    offload_optimizer: bool = False
    offload_params: bool = False

    @model_validator(mode="after")
    def _self_consistent(self):
        # Rules between tp / pp / vpp / cp / sp belong to the layout: toolkit/parallel/rules.py.
        if self.offload_params and self.zero_stage != 3:
            raise PydanticCustomError(
                "offload_params_needs_zero3", "offload_params=true needs zero_stage=3 (zero_stage={stage})",
                {"stage": self.zero_stage},
            )
        if self.offload_optimizer and self.zero_stage == 0:
            raise PydanticCustomError(
                "offload_optimizer_needs_zero", "offload_optimizer=true needs zero_stage 1, 2 or 3 (zero_stage=0)", {}
            )
        return self


class LoraSpec(Section):
    """LoRA adapters on the attention and MLP linears (toolkit/train/lora/adapters.py); the base weights stay frozen.

    `targets` are HF module names as PEFT matches them (the last name component, e.g. q_proj, v_proj, down_proj;
    GPT-2: c_attn, c_proj, c_fc); None: every linear of attention and MLP. `init_adapter`: a PEFT adapter
    directory (adapter_config.json + adapter_model.safetensors) to start from instead of PEFT's initialisation.
    `train_embeddings`: the input embedding and the output layer train as well (PEFT's `modules_to_save`; a tied
    pair stays one tensor, PEFT's `ensure_weight_tying`), exported in final-hf-adapter next to the LoRA matrices.
    `export`: what the run writes at its end: `adapter` (final-hf-adapter only: PEFT's files, no merged copy of the
    whole model; `dsmt convert merge-lora` merges later), `merged` (final-hf and final-mcore with the adapters
    merged in), or `both`."""

    rank: int = 8
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    targets: list[str] | None = None
    init_adapter: str | None = None
    train_embeddings: bool = False
    export: Literal["adapter", "merged", "both"] = "both"

    @model_validator(mode="after")
    def _embeddings_need_the_merged_export(self):
        if self.train_embeddings and self.export == "adapter":
            raise PydanticCustomError(
                "lora_export", "training.lora.train_embeddings with export=adapter: the trained embeddings reach "
                "final-hf-adapter through the merged export (gathered and unpadded there); set training.lora.export "
                "to both, or leave the embeddings frozen", {})
        return self

    @field_validator("rank")
    @classmethod
    def _rank_positive(cls, value):
        if value < 1:
            raise PydanticCustomError("lora_rank", "training.lora.rank={rank} must be at least 1 (typical: 8 to 64)",
                                      {"rank": value})
        return value

    @field_validator("init_adapter")
    @classmethod
    def _adapter_path_ok(cls, value):
        return _safe_path(value, what="training.lora.init_adapter")


# W&B names: no '/', '#', '?', '%', ':' (W&B refuses them in projects) and nothing a shell or env file would parse.
WANDB_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class WandbSpec(Section):
    """W&B through DeepSpeed's wandb monitor; `name` reaches wandb.init as WANDB_NAME (toolkit/train/job/run.py)."""

    project: str
    name: str | None = None  # None: W&B's own random run name
    entity: str | None = None  # W&B user or team (DeepSpeed's `team`); None: the logged-in user's default
    group: str | None = None  # groups runs in the W&B UI

    @field_validator("project", "name", "entity", "group")
    @classmethod
    def _name_safe(cls, value, info):
        if value is not None and not WANDB_NAME_RE.match(value):
            raise PydanticCustomError(
                "wandb_value", "{value} is not a W&B {field} dsmt accepts: use 1-128 letters, digits, '_', '.', '-' "
                "(starting with a letter or digit)", {"field": info.field_name, "value": repr(value)})
        return value


class TrainingSpec(Section):
    global_batch_size: int | None = Field(None, ge=1)  # sequences per optimizer step
    global_batch_tokens: int | None = Field(None, ge=1)  # alternative: tokens per step (a multiple of seq_length)
    micro_batch_size: int = Field(1, ge=1)  # sequences per rank per forward
    seq_length: int = Field(2048, ge=1)
    precision: FloatType = "bf16"  # bfloat16 / float16 / float32 read as bf16 / fp16 / fp32
    recompute: Literal["none", "selective", "full"] = "none"
    # Attention kernel: fused (Transformer Engine / flash: no s x s scores stored; needed by cp > 1), local
    # (megatron's unfused torch attention: stores the s x s scores), auto: fused on cuda, local on cpu.
    attention: Literal["auto", "fused", "local"] = "auto"
    # Fused kernels (toolkit/adapters/fusions.py). auto: megatron's fused bias-activation and bias-dropout-add and
    # TE's fused RoPE where the device and layers have them; on GPUs megatron compiles the first two with
    # torch.compile at step 1, which needs a C compiler and a findable libcuda on every node (`dsmt preflight`
    # checks). off: not those two, and megatron's other compiled helpers run eagerly: nothing compiles, for an
    # image without a compiler (the elementwise ops run slower); TE's fused RoPE, a prebuilt kernel, stays.
    fusions: Literal["auto", "off"] = "auto"
    lr: float = Field(3e-4, gt=0)
    min_lr: float = Field(3e-5, ge=0)
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(100, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    adam_beta1: float = Field(0.9, gt=0, lt=1)
    adam_beta2: float = Field(0.95, gt=0, lt=1)
    adam_eps: float = Field(1e-8, gt=0)
    grad_clip: float = Field(1.0, ge=0)  # 0: no clipping
    train_steps: int = Field(1000, ge=1)
    checkpoint_interval: int = Field(500, ge=1)  # steps
    # Newest complete checkpoints kept (null: every one). Each holds the fp32 master weights and both Adam moments
    # of the trainable parameters: 12 bytes per parameter (an 8B model: ~100 GB), so keeping every one fills a
    # disk in a long run.
    keep_checkpoints: int | None = Field(2, ge=1)
    # Save in the background: the saving step copies each rank's shard of the state to host memory and training
    # goes on while a writer thread writes it (at most one save in flight; the next save, the end of training and
    # a SIGTERM wait for it). null: on with GPUs, off on the CPU backend (its cores are the training's).
    async_save: bool | None = None
    # Every N steps the checkpoint of that step also holds hf/: the model as transformers loads it (and the LoRA
    # adapter as training.lora.export says). null: only the final export (final-hf).
    export_hf_interval: int | None = Field(None, ge=1)
    log_interval: int = Field(10, ge=1)  # steps
    # fp16 only: DeepSpeed skips a step whose gradients overflow and lowers the loss scale; after this many
    # skipped steps in a row the run stops (the scale cannot recover). bf16 / fp32 stop at the first non-finite
    # loss or gradient norm.
    max_skipped_steps: int = Field(10, ge=1)
    # How long a rank waits in a collective (the world group and megatron's groups; DeepSpeed's own keep torch's
    # default) before it fails and names the rank that stalled. null: 600 s on GPUs (NCCL), 180 s on the CPU, or
    # longer when the planner's bound on a checkpoint's write is (3 x a node's share at 2 GB/s + 60 s).
    collective_timeout_s: float | None = Field(None, gt=0)
    # Preemption: SLURM sends SIGTERM at preemption and this long before the time limit (job.sbatch asks for it
    # with --signal=TERM@N), then SIGKILL after its grace period (KillWait, commonly 30-120 s). On SIGTERM the job
    # finishes its current step, saves a checkpoint and exits with code 75 (EX_TEMPFAIL: run it again to resume).
    # Set it above one step plus one checkpoint save of this job.
    preemption_grace_s: int = Field(90, ge=1, le=65535)  # sbatch refuses a --signal time above 65535
    # A rank whose heartbeat stops this long is named as stopped / hung and the job is ended (dsmt's launcher).
    hang_timeout_s: float = Field(60.0, gt=0)
    seed: int = Field(1234, ge=0)
    output_dir: str = "runs/dsmt"
    tensorboard: bool = False
    wandb: WandbSpec | None = None  # None: no Weights & Biases logging
    sync_batchnorm: bool = False  # models without an adapter: BatchNorm -> torch.nn.SyncBatchNorm (stats over DP)
    lora: LoraSpec | None = None  # None: full fine-tuning
    method: Literal["sft", "dpo", "simpo", "orpo"] = "sft"  # preference pairs: toolkit/spec/preference.py
    dpo: DpoSpec | None = None  # method dpo's settings; None: TRL's defaults
    simpo: SimpoSpec | None = None  # method simpo's
    orpo: OrpoSpec | None = None  # method orpo's
    # Validation (data.validation_path / validation_fraction): before step 1 (logged as step 0), every
    # eval_interval steps and after the last step; None: at the start and the end only.
    eval_interval: int | None = Field(None, ge=1)

    @field_validator("output_dir")
    @classmethod
    def _out_ok(cls, value):
        return _safe_path(value, what="training.output_dir")

    @field_validator("fusions", mode="before")
    @classmethod
    def _fusions_word(cls, value):
        """YAML 1.1 (PyYAML, and --set) reads a bare `off` / `on` as a boolean: off is "off", on is "auto" (every
        fusion the machine has)."""
        return {False: "off", True: "auto"}.get(value, value) if isinstance(value, bool) else value

    @model_validator(mode="before")
    @classmethod
    def _default_warmup(cls, data):
        """Unset warmup_steps: 100, but never more than a tenth of train_steps (a 20-step smoke run warms up 2)."""
        if isinstance(data, dict) and "warmup_steps" not in data:
            steps = data.get("train_steps", cls.model_fields["train_steps"].default)
            if isinstance(steps, int) and steps >= 1:
                data = {**data, "warmup_steps": min(cls.model_fields["warmup_steps"].default, steps // 10)}
        return data

    @model_validator(mode="after")
    def _self_consistent(self):
        if self.global_batch_size is not None and self.global_batch_tokens is not None:
            raise PydanticCustomError(
                "batch_both", "give global_batch_size (sequences) or global_batch_tokens, not both ({gbs}, {gbt})",
                {"gbs": self.global_batch_size, "gbt": self.global_batch_tokens},
            )
        if self.global_batch_tokens is not None and self.global_batch_tokens % self.seq_length:
            below = self.global_batch_tokens // self.seq_length * self.seq_length
            raise PydanticCustomError(
                "batch_tokens_vs_seq",
                "global_batch_tokens={gbt} is not a multiple of seq_length={seq}; nearest valid: {a}, {b}",
                {"gbt": self.global_batch_tokens, "seq": self.seq_length, "a": below or self.seq_length,
                 "b": below + self.seq_length},
            )
        check_method(method=self.method, settings={"dpo": self.dpo, "simpo": self.simpo, "orpo": self.orpo})
        if self.min_lr > self.lr:
            raise PydanticCustomError("min_lr_above_lr", "min_lr={min_lr} exceeds lr={lr}", {"min_lr": self.min_lr, "lr": self.lr})
        if self.warmup_steps >= self.train_steps:
            raise PydanticCustomError(
                "warmup_vs_steps", "warmup_steps={w} must be below train_steps={t}; set training.warmup_steps to {fix}",
                {"w": self.warmup_steps, "t": self.train_steps,
                 "fix": f"{tenth} (a tenth of the run) or 0 (none)" if (tenth := self.train_steps // 10) else "0"})
        return self



class CommunicationSpec(Section):
    overlap_comm: bool = True
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_elements: int = Field(500_000_000, ge=1)
    allgather_bucket_elements: int = Field(500_000_000, ge=1)
    prefetch_bucket_elements: int = Field(50_000_000, ge=1)  # ZeRO-3
    param_persistence_threshold_elements: int = Field(100_000, ge=0)  # ZeRO-3
    communication_data_type: FloatType | None = None  # DP reduction dtype; None: fp32
    grad_accum_dtype: FloatType | None = None  # micro-batch accumulation; None: fp32
    overlap_p2p_comm: bool = False  # megatron interleaved pipeline only
    nccl_debug: Literal["VERSION", "WARN", "INFO", "TRACE"] = "WARN"
    nccl_ib_hca: str | None = None  # e.g. mlx5_0,mlx5_1
    nccl_ib_gid_index: int = Field(3, ge=0)  # RoCE v2
    extra_env: dict[str, str] = Field(default_factory=dict)  # more exports for .deepspeed_env

    @field_validator("nccl_ib_hca")
    @classmethod
    def _hca_safe(cls, value):
        if value is not None and not ENV_VALUE_RE.match(value):
            raise PydanticCustomError("env_value", "nccl_ib_hca={value} has characters outside [A-Za-z0-9_.,:=^+-]", {"value": repr(value)})
        return value

    @field_validator("extra_env")
    @classmethod
    def _env_safe(cls, value):
        for name, text in value.items():
            if not ENV_NAME_RE.match(name):
                raise PydanticCustomError("env_name", "extra_env name {name} must match [A-Z][A-Z0-9_]*", {"name": repr(name)})
            if not ENV_VALUE_RE.match(str(text)):
                raise PydanticCustomError(
                    "env_value", "extra_env {name}={value}: values may use only [A-Za-z0-9_.,:/=^+-]",
                    {"name": name, "value": repr(text)},
                )
        return value


class JobSpec(Section):
    model: ModelSpec
    cluster: ClusterSpec = Field(default_factory=ClusterSpec)
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    communication: CommunicationSpec = Field(default_factory=CommunicationSpec)
