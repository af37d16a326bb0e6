"""The resolved parallel layout and batch arithmetic: the one place every generated number comes from."""

from __future__ import annotations

from pathlib import Path

import dataclasses

from toolkit.models import shapes
from toolkit.errors import DsmtError
from toolkit.parallel.layout import Layout, divisors  # noqa: F401  (divisors re-exported for the checks)
from toolkit.spec.schema import JobSpec


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunLayout(Layout):
    """The spec's parallel layout with the cluster and batch numbers it runs with."""

    nodes: int
    gpus_per_node: int
    micro_batch_size: int  # sequences per rank per forward
    grad_accum_steps: int  # micro-batches per optimizer step per rank (megatron's num_microbatches)
    global_batch_size: int  # sequences per optimizer step
    seq_length: int

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_length


def world_size_of(spec: JobSpec) -> int:
    return spec.cluster.nodes * spec.cluster.gpus_per_node


def requested_global_batch(spec: JobSpec, *, dp: int) -> int:
    """Sequences per step as the spec asks for it (tokens converted; neither given: one micro-batch per rank)."""
    training = spec.training
    if training.global_batch_size is not None:
        return training.global_batch_size
    if training.global_batch_tokens is not None:
        return training.global_batch_tokens // training.seq_length
    return training.micro_batch_size * dp


def parallel_layout(spec: JobSpec) -> Layout:
    """The spec's parallel topology, dp taken from the world (rounded down when tp × cp × pp does not divide it:
    the world_size rule in toolkit/parallel/rules.py reports that)."""
    parallel = spec.parallel
    model_parallel = parallel.tp * parallel.cp * parallel.pp
    return Layout(tp=parallel.tp, pp=parallel.pp, vpp=parallel.vpp or 1, cp=parallel.cp, ep=parallel.ep,
                  sp=parallel.sequence_parallel, dp=max(1, world_size_of(spec) // model_parallel))


def spec_attention(spec: JobSpec) -> str:
    """The attention kind the run's layers use: `training.attention`, auto resolved for the spec's device and
    model (an encoder is built from megatron's local post-LayerNorm layers on every device)."""
    from toolkit.parallel.rules import resolve_attention

    return resolve_attention(attention=spec.training.attention, device=spec.cluster.device,
                             encoder=spec_is_encoder(spec))


def spec_model_type(spec: JobSpec) -> str | None:
    """model_type of the spec's model: model.path's config.json or model.config (None when there is none to read)."""
    import json

    if spec.model.config is not None:
        return spec.model.config.get("model_type")
    if spec.model.path is None or not (Path(spec.model.path) / "config.json").is_file():
        return None
    try:
        return json.loads((Path(spec.model.path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def spec_is_encoder(spec: JobSpec) -> bool:
    """True for a model of an adapter family with encoder heads (BERT)."""
    from toolkit.adapters.family import get_family, supported_model_types

    model_type = spec_model_type(spec)
    return model_type in supported_model_types() and get_family(model_type).is_encoder


def derive_layout(spec: JobSpec) -> RunLayout:
    """The layout of a spec that passed its checks; raises DsmtError naming the factors otherwise."""
    world, parallel = world_size_of(spec), parallel_layout(spec)
    if parallel.world_size != world:
        raise DsmtError(f"world_size({world}) is not divisible by tp({parallel.tp}) * cp({parallel.cp}) * "
                        f"pp({parallel.pp}); run `dsmt check`")
    micro, dp = spec.training.micro_batch_size, parallel.dp
    global_batch = requested_global_batch(spec, dp=dp)
    if global_batch % (micro * dp):
        raise DsmtError(
            f"global_batch_size({global_batch}) is not divisible by micro_batch_size({micro}) * dp({dp}); run `dsmt check`"
        )
    return RunLayout(**parallel.parallel_fields(), nodes=spec.cluster.nodes, gpus_per_node=spec.cluster.gpus_per_node,
                     micro_batch_size=micro, grad_accum_steps=global_batch // (micro * dp),
                     global_batch_size=global_batch, seq_length=spec.training.seq_length)


def padded_vocab_size(*, vocab_size: int, divisible_by: int) -> int:
    """The adapters' padding (toolkit/models/shapes.py): a multiple of divisible_by, independent of tp."""
    return shapes.padded_vocab_size(vocab_size, multiple=divisible_by)

