"""Models without a megatron-core adapter: DeepSpeed ZeRO data parallelism only (tp = pp = 1).

Any HF model whose `model_type` has no adapter (`toolkit.adapters.family.supported_model_types()`), e.g.
ResNetForImageClassification or BertForMaskedLM, trains as the plain HF module wrapped by DeepSpeed: no mpu, so
the whole world is the data-parallel group, and DeepSpeed owns everything (DP reduction, ZeRO 0-3 partitioning,
clipping, optimizer, LR schedule, checkpoints). The loop is DeepSpeed's own, `engine(**batch)` /
`engine.backward(out.loss)` / `engine.step()`, with the loss the HF model computes from `labels`.

Caveat for models with BatchNorm (ResNet): its statistics are computed per rank over the local micro-batch, so
DP2 is not the same computation as one process on the global batch (as with any DDP without SyncBatchNorm).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from toolkit.errors import DsmtError
from toolkit.train.engine import StepStats

PLAIN_NOTICE = ("model_type {model_type} has no megatron-core adapter: training with DeepSpeed ZeRO-{stage} "
                "data parallelism only (tp=1, pp=1)")

# Model kinds PlainBatches can feed, by the suffix of the HF class name (config.architectures[0]).
KIND_SUFFIXES = {
    "image_classification": ("ForImageClassification",),
    "masked_lm": ("ForMaskedLM",),
    "sequence_classification": ("ForSequenceClassification",),
    "causal_lm": ("ForCausalLM", "LMHeadModel"),
}
DEFAULT_IMAGE_SIZE = 32  # ResNet configs carry no image size (the net is size-agnostic); small keeps CPU tests fast
MASKED_FRACTION = 0.15  # BERT's masking rate


def _model_type(hf_dir: Path) -> str:
    config_path = Path(hf_dir) / "config.json"
    if not config_path.is_file():
        raise DsmtError(f"{config_path} does not exist: an HF model directory needs a config.json")
    model_type = json.loads(config_path.read_text()).get("model_type")
    if not model_type:
        raise DsmtError(f"{config_path} has no model_type: cannot tell which model it is")
    return model_type


def is_plain_model(hf_dir: Path) -> bool:
    """True when config.json's model_type has no megatron-core adapter (it trains with DeepSpeed DP only)."""
    from toolkit.adapters.family import supported_model_types

    return _model_type(hf_dir) not in supported_model_types()


def plain_notice(*, model_type: str, zero_stage: int) -> str:
    return PLAIN_NOTICE.format(model_type=model_type, stage=zero_stage)


def check_plain_layout(*, tp: int, pp: int, model_type: str | None = None) -> None:
    """Refuse tensor / pipeline parallelism for a model that has no megatron-core adapter."""
    if tp == 1 and pp == 1:
        return
    from toolkit.adapters.family import supported_model_types

    name = model_type if model_type is not None else "of this model"
    raise DsmtError(f"model_type {name} has no megatron-core adapter, so it trains with DeepSpeed data parallelism "
                    f"only: set parallel.tp=1 and parallel.pp=1 (got tp={tp}, pp={pp}); adapters exist for: "
                    f"{', '.join(supported_model_types())}")


def load_plain_model(hf_dir: Path, *, dtype: torch.dtype):
    """The HF model of `hf_dir`, by the class named in config.json's `architectures[0]` (e.g.
    ResNetForImageClassification, BertForMaskedLM), else AutoModelForCausalLM."""
    import transformers

    config = json.loads((Path(hf_dir) / "config.json").read_text())
    architectures = config.get("architectures") or []
    model_class = getattr(transformers, architectures[0], None) if architectures else None
    if model_class is not None:
        return model_class.from_pretrained(hf_dir, dtype=dtype)
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype)
    except (ValueError, KeyError) as err:
        raise DsmtError(
            f"{hf_dir}: config.json names architectures={architectures} (model_type {config.get('model_type')!r}); "
            f"transformers {transformers.__version__} has no such class and AutoModelForCausalLM cannot load it "
            f"({err}); save the model with save_pretrained so architectures names its HF class") from err


def model_kind(model_config) -> str:
    """Which kind of inputs the model takes, from the class name in `model_config.architectures[0]`."""
    architectures = getattr(model_config, "architectures", None) or []
    for kind, suffixes in KIND_SUFFIXES.items():
        if architectures and architectures[0].endswith(suffixes):
            return kind
    supported = "; ".join(f"{kind} (*{'/*'.join(suffixes)})" for kind, suffixes in KIND_SUFFIXES.items())
    raise DsmtError(f"architectures={architectures} (model_type {getattr(model_config, 'model_type', None)!r}) is "
                    f"not a model kind dsmt can make training batches for; supported kinds: {supported}")


class PlainEngine:
    """A DeepSpeed engine around a plain HF module; the world is the data-parallel group."""

    def __init__(self, *, model, ds_config: dict):
        import deepspeed

        params = [p for p in model.parameters() if p.requires_grad]
        self._engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=ds_config)

    @property
    def engine(self):
        return self._engine

    def train_step(self, micro_batches: list[dict]) -> StepStats:
        """One optimizer step over this rank's micro-batches."""
        import torch.distributed as dist

        start = time.perf_counter()
        lr = self._engine.optimizer.param_groups[0]["lr"]  # this step's rate (the scheduler steps after the update)
        dtype = next(self._engine.module.parameters()).dtype
        losses = []
        for batch in micro_batches:
            # DeepSpeed casts inputs only for fp16: floating inputs (pixel_values) must match bf16 weights.
            inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}
            out = self._engine(**inputs)
            self._engine.backward(out.loss)  # DeepSpeed scales by 1/gradient_accumulation_steps
            self._engine.step()  # steps at the accumulation boundary only
            losses.append(out.loss.detach().float())
        loss = torch.stack(losses).mean().reshape(1)
        dist.all_reduce(loss)
        norm = self._engine.get_global_grad_norm()
        return StepStats(loss=loss.item() / dist.get_world_size(), grad_norm=None if norm is None else float(norm),
                         lr=float(lr), step_time_s=time.perf_counter() - start)


class PlainBatches:
    """Synthetic, deterministic training batches for a plain HF model (real data for these kinds is out of scope).

    Sample assignment follows toolkit/data/batches.py: with `G = micro_batch_size * num_microbatches * dp_size`,
    step `s` trains on global positions `g = s*G + j`, and `j = (m * dp_size + r) * micro_batch_size + i` is row
    `i` of micro-batch `m` on rank `r`; so ranks take disjoint slices and `global_batch_for_step` (the
    (micro-batch, rank) order) is what one process with `dp_size=1` and `num_microbatches * dp_size` micro-batches
    trains on. Sample `g` is drawn from a generator seeded by `(seed, g)` alone: a pure function, and learnable:
      image_classification     `pixel_values` [C, H, W] = a fixed per-label pattern + noise; `labels` a class id.
                               H = W = config.image_size when the config has one, else 32.
      masked_lm                `input_ids` an arithmetic sequence mod (vocab_size - 1) with random start and
                               stride; ~15% of positions (at least one) replaced by the mask id (config's
                               mask_token_id, else vocab_size - 1, which the sequences never use); `labels` the
                               original ids there, -100 elsewhere; `attention_mask` ones.
      sequence_classification  such a sequence with stride `label + 1`; `labels` the class id (a float target
                               when num_labels == 1, i.e. regression); `attention_mask` ones.
      causal_lm                such a sequence; `labels` = `input_ids` (HF shifts them itself).
    """

    def __init__(self, *, model_config, micro_batch_size: int, num_microbatches: int, dp_rank: int, dp_size: int,
                 seed: int, seq_length: int):
        problems = [f"{name}={value} must be >= 1" for name, value in
                    (("micro_batch_size", micro_batch_size), ("num_microbatches", num_microbatches),
                     ("dp_size", dp_size), ("seq_length", seq_length)) if value < 1]
        if not 0 <= dp_rank < max(dp_size, 1):
            problems.append(f"dp_rank={dp_rank} must be in 0 .. dp_size-1 = {dp_size - 1}")
        if problems:
            raise DsmtError("micro-batch layout is invalid: " + "; ".join(problems))
        self.kind = model_kind(model_config)
        self.config = model_config
        self.micro_batch_size = micro_batch_size
        self.num_microbatches = num_microbatches
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.seq_length = seq_length
        self.num_labels = int(getattr(model_config, "num_labels", 2))
        if self.kind == "image_classification":
            self.image_size = int(getattr(model_config, "image_size", None) or DEFAULT_IMAGE_SIZE)
            self.num_channels = int(getattr(model_config, "num_channels", 3))
            patterns = torch.Generator().manual_seed(seed)
            self._patterns = torch.randn(self.num_labels, self.num_channels, self.image_size, self.image_size,
                                         generator=patterns)
        else:
            self.vocab_size = int(model_config.vocab_size)
            self.mask_id = getattr(model_config, "mask_token_id", None)
            if self.mask_id is None:
                self.mask_id = self.vocab_size - 1

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.num_microbatches * self.dp_size

    def batches_for_step(self, step: int) -> list[dict[str, torch.Tensor]]:
        """This rank's `num_microbatches` micro-batches for `step`, as keyword inputs of the model."""
        first = self._first_position(step)
        batches = []
        for micro in range(self.num_microbatches):
            row0 = first + (micro * self.dp_size + self.dp_rank) * self.micro_batch_size
            batches.append(self._collate(range(row0, row0 + self.micro_batch_size)))
        return batches

    def global_batch_for_step(self, step: int) -> dict[str, torch.Tensor]:
        """All `G` samples of `step` as one batch, rows in position order `j`."""
        first = self._first_position(step)
        return self._collate(range(first, first + self.global_batch_size))

    def _first_position(self, step: int) -> int:
        if step < 0:
            raise DsmtError(f"step={step} must be >= 0")
        return step * self.global_batch_size

    def _collate(self, positions) -> dict[str, torch.Tensor]:
        samples = [self._sample(g) for g in positions]
        return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}

    def _sample(self, position: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + position)
        if self.kind == "image_classification":
            label = int(torch.randint(self.num_labels, (), generator=generator))
            noise = torch.randn(self._patterns.shape[1:], generator=generator)
            return {"pixel_values": self._patterns[label] + 0.5 * noise, "labels": torch.tensor(label)}
        if self.kind == "sequence_classification":
            label = int(torch.randint(self.num_labels, (), generator=generator))
            ids = self._sequence(generator, stride=label + 1)
            target = torch.tensor(float(label)) if self.num_labels == 1 else torch.tensor(label)
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": target}
        ids = self._sequence(generator, stride=int(torch.randint(1, 4, (), generator=generator)))
        if self.kind == "causal_lm":
            return {"input_ids": ids, "labels": ids.clone()}
        masked = torch.rand(self.seq_length, generator=generator) < MASKED_FRACTION
        masked[int(torch.randint(self.seq_length, (), generator=generator))] = True  # never an all -100 row
        return {"input_ids": torch.where(masked, self.mask_id, ids), "attention_mask": torch.ones_like(ids),
                "labels": torch.where(masked, ids, -100)}

    def _sequence(self, generator: torch.Generator, *, stride: int) -> torch.Tensor:
        start = int(torch.randint(self.vocab_size - 1, (), generator=generator))
        return (start + stride * torch.arange(self.seq_length)) % (self.vocab_size - 1)


def export_plain(*, engine, out_dir: Path) -> None:
    """Save the trained model with save_pretrained into `out_dir` (replaced if present). Collective: every rank
    calls it; under ZeRO-3 the partitioned parameters are gathered first. Rank 0 writes into a temporary
    sibling and renames it, so `out_dir` is never a half-written model."""
    import torch.distributed as dist

    from toolkit.convert.checkpoint import atomic_output_dir
    from toolkit.train.zero3 import zero3_gathered

    with zero3_gathered(engine):
        if dist.get_rank() == 0:
            with atomic_output_dir(Path(out_dir), overwrite=True) as temp_dir:
                engine.module.save_pretrained(temp_dir)
    dist.barrier()
