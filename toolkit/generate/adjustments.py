"""Where the run files carry a value other than the spec's, and why: summary.txt lists each one.

job.resolved.yaml stays the spec as given, every default written out: it is what the trainer loads and what a user
regenerates from at another layout (`dsmt generate run/job.resolved.yaml --set parallel.pp=1 ...`), so a value the
layout forces off (overlap_comm at pp > 1) must not be frozen into it. The files built from it carry what runs,
and each difference is said here. The JSON ones are found by comparing the built file with the spec (JSON_MIRRORS),
so the line follows what deepspeed_config.py / megatron_settings.py really write; tests/generate holds that every
difference of a mirrored key has its line.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from toolkit.generate.env import environment, preset_environment
from toolkit.generate.scripts import mpirun_interface
from toolkit.spec.layout import RunLayout
from toolkit.spec.schema import JobSpec

# spec field -> (run file, dotted key in it, why the file may say otherwise). A spec value of None is a default the
# file resolves (grad_accum_dtype None -> fp32), not an adjustment.
JSON_MIRRORS: dict[str, tuple[str, str, str]] = {
    "communication.overlap_comm": (
        "ds_config.json", "zero_optimization.overlap_comm",
        "DeepSpeed allows no overlap when megatron's pipeline schedule drives the reduction (pp > 1)"),
    "communication.grad_accum_dtype": (
        "ds_config.json", "data_types.grad_accum_dtype",
        "precision fp32 has no 16-bit gradients: they accumulate in fp32"),
    "communication.overlap_p2p_comm": (
        "megatron.json", "transformer_config.overlap_p2p_comm",
        "megatron overlaps pipeline sends with compute only in the interleaved schedule (parallel.vpp > 1)"),
    "parallel.vpp": (
        "megatron.json", "transformer_config.virtual_pipeline_model_parallel_size",
        "one virtual stage per rank is megatron's plain (not interleaved) schedule, written as null"),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Adjustment:
    """One value a run file carries in place of the spec's (or of the preset the spec selects)."""

    setting: str  # the spec field (or exported variable) adjusted
    given: Any  # what the spec (or preset) says
    carried: Any  # what the run file says (None is JSON's null; a sentence where the file writes nothing)
    where: str  # the file, and the key in it
    reason: str
    given_by: str = "spec"  # "spec", or "preset" for a .deepspeed_env default replaced by communication.extra_env

    def line(self) -> str:
        return (f"{self.setting}: {self.given_by} {_shown(self.given)} -> {_shown(self.carried)} in {self.where}: "
                f"{self.reason}")


def _shown(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)  # true / false / null, as the files spell them


def run_file_adjustments(*, spec: JobSpec, layout: RunLayout, ds_config: dict, megatron: dict) -> list[Adjustment]:
    """Every value the run files carry other than the spec gives it, in file order."""
    built = {"ds_config.json": ds_config, "megatron.json": megatron}
    return [*_json_adjustments(spec=spec, built=built), *_batch_adjustments(layout=layout, ds_config=ds_config),
            *_env_adjustments(spec=spec), *_script_adjustments(spec=spec)]


def _json_adjustments(*, spec: JobSpec, built: dict[str, dict]) -> list[Adjustment]:
    found, given_tree = [], spec.model_dump()
    for setting, (file_name, key, reason) in JSON_MIRRORS.items():
        (_, given), (present, carried) = _lookup(given_tree, setting), _lookup(built[file_name], key)
        if given is not None and present and carried != given:
            found.append(Adjustment(setting=setting, given=given, carried=carried, where=f"{file_name} {key}",
                                    reason=reason))
    return found


def _lookup(tree: dict, dotted: str) -> tuple[bool, Any]:
    """(whether `dotted` is in `tree`, its value); a key a file leaves out (ZeRO's at stage 0) is no adjustment."""
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _batch_adjustments(*, layout: RunLayout, ds_config: dict) -> list[Adjustment]:
    if ds_config["train_batch_size"] == layout.global_batch_size:
        return []
    return [Adjustment(
        setting="training.global_batch_size", given=layout.global_batch_size, carried=ds_config["train_batch_size"],
        where="ds_config.json train_batch_size",
        reason=f"DeepSpeed's data-parallel group is dp x cp ({layout.dp} x {layout.cp}) and counts each CP rank's "
               f"copy of a micro-batch; a step still takes {layout.global_batch_size} sequences")]


def _env_adjustments(*, spec: JobSpec) -> list[Adjustment]:
    presets, exported = preset_environment(spec=spec), environment(spec=spec)
    found = [Adjustment(setting=name, given=presets[name], carried=exported[name], where=".deepspeed_env",
                        given_by="preset", reason="communication.extra_env sets it, and extra_env wins over the presets")
             for name in spec.communication.extra_env if name in presets and presets[name] != exported[name]]
    if spec.communication.nccl_ib_hca is not None and "NCCL_IB_HCA" not in exported:
        found.append(Adjustment(
            setting="communication.nccl_ib_hca", given=spec.communication.nccl_ib_hca, carried="not written",
            where=".deepspeed_env", reason=f"no InfiniBand on this cluster (device {spec.cluster.device}, "
                                           f"interconnect {spec.cluster.interconnect})"))
    return found


def _script_adjustments(*, spec: JobSpec) -> list[Adjustment]:
    cluster, found = spec.cluster, []
    iface = mpirun_interface(spec)
    if cluster.launcher == "openmpi" and cluster.network_interface not in (None, iface):
        found.append(Adjustment(
            setting="cluster.network_interface", given=cluster.network_interface, carried=iface,
            where="launch_deepspeed.sh (mpirun --mca btl_tcp_if_include)",
            reason="one node: mpirun's ranks talk over loopback"))
    if cluster.master_addr is not None and cluster.hosts == "slurm":
        found.append(Adjustment(
            setting="cluster.master_addr", given=cluster.master_addr, carried="the allocation's first node",
            where="launch_deepspeed.sh, launch_torchrun.sh, job.sbatch",
            reason="under SLURM (cluster.hosts: slurm) the nodes are known only at run time"))
    return found
