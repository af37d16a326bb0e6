"""All artifacts of a spec, rendered purely (`render_all`) and written into a run directory atomically.

The launch scripts and .deepspeed_env come from the templates of launch/, or a site's copies (`templates`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from toolkit.data.check_digest import write_job_digest
from toolkit.errors import DsmtError
from toolkit.generate.adjustments import run_file_adjustments
from toolkit.generate.env import render_deepspeed_env
from toolkit.generate.hostfile import render_hostfile
from toolkit.generate.megatron_settings import build_megatron_settings
from toolkit.generate.remote_shell import check_run_dir
from toolkit.generate.scripts import RESOLVED_SPEC, TRAIN_MODULE, render_launch_deepspeed, render_launch_torchrun, render_sbatch
from toolkit.generate.summary import render_summary
from toolkit.generate.templates import LaunchTemplates, load_templates
from toolkit.spec.checked import CheckedJob
from toolkit.spec.load import dump_spec, model_shape

EXECUTABLES = ("launch_deepspeed.sh", "launch_torchrun.sh", "job.sbatch")
# job.resolved.yaml stays the spec as given (toolkit/generate/adjustments.py says why); its header says where the
# run files differ. YAML comments: the trainer and `dsmt generate` read it back unchanged.
RESOLVED_SPEC_HEADER = (
    "# The job spec as given, every default written out: the trainer loads it, and `dsmt generate` reads it back.\n"
    "# The run files built from it may adjust a value for the layout (e.g. ds_config.json's overlap_comm is false at\n"
    "# pp > 1): summary.txt lists every adjustment and why. `dsmt generate` writes absolute paths, this machine's:\n"
    "# the run directory and output_dir must be at the same path on every node (a relative path would be taken\n"
    "# against this file's folder).\n"
)


def render_all(*, job: CheckedJob, run_dir: str, train_module: str = TRAIN_MODULE,
               templates: LaunchTemplates | None = None) -> dict[str, str]:
    """File name -> content for a checked job (toolkit/check/job.py: a spec with errors never gets here).

    `train_module` is what the scripts launch; tests swap in a probe to exercise the launchers. `templates`:
    `load_templates(site_dir=...)` for a site's copies; None renders the shipped ones.
    """
    if templates is None:
        templates = load_templates(site_dir=None)
    spec, layout = job.spec, job.layout
    shape = job.model if job.model is not None else model_shape(spec.model)  # not a transformer LM: its error
    script_args = {"spec": spec, "layout": layout, "templates": templates, "train_module": train_module}
    ds_config = job.ds_config()
    megatron = build_megatron_settings(spec=spec, layout=layout, shape=shape)
    adjustments = run_file_adjustments(spec=spec, layout=layout, ds_config=ds_config, megatron=megatron)
    return {
        "ds_config.json": _json(ds_config),
        "megatron.json": _json(megatron),
        "hostfile": render_hostfile(spec=spec),
        "launch_deepspeed.sh": render_launch_deepspeed(**script_args),
        "launch_torchrun.sh": render_launch_torchrun(**script_args),
        "job.sbatch": render_sbatch(**script_args, run_dir=run_dir),
        ".deepspeed_env": render_deepspeed_env(spec=spec, templates=templates),
        "summary.txt": render_summary(spec=spec, layout=layout, shape=shape, run_dir=run_dir, adjustments=adjustments),
        RESOLVED_SPEC: RESOLVED_SPEC_HEADER + dump_spec(spec),
    }


def _json(data: dict) -> str:
    return json.dumps(data, indent=2) + "\n"


def write_run_dir(*, job: CheckedJob, out_dir: Path, overwrite: bool = False, train_module: str = TRAIN_MODULE,
                  templates: LaunchTemplates | None = None) -> list[Path]:
    """Render everything (`templates` as for render_all), write it to a temporary sibling directory, then rename
    it into place: nothing is written when a template fails. Beside them, data_check.json: the digest of the
    record files the job's checks formatted, which the ranks verify instead of formatting them again
    (toolkit/data/check_digest.py; not rendered by render_all: it depends on the files, not on the spec alone)."""
    out_dir = out_dir.expanduser().absolute()
    check_run_dir(spec=job.spec, run_dir=out_dir)  # a path DeepSpeed's pdsh runner would hand to a shell bare
    if out_dir.exists() and not out_dir.is_dir():
        raise DsmtError(f"--out {out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise DsmtError(f"--out {out_dir} exists and is not empty; pass --overwrite to replace it")
    files = render_all(job=job, run_dir=str(out_dir), train_module=train_module, templates=templates)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        for name, text in files.items():
            (staging / name).write_text(text)
            (staging / name).chmod(0o755 if name in EXECUTABLES else 0o644)
        digest = write_job_digest(job=job, directory=staging)
        if digest is not None:
            digest.chmod(0o644)
        staging.chmod(0o755)
        _swap_into_place(staging=staging, out_dir=out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return [out_dir / name for name in files] + ([out_dir / digest.name] if digest is not None else [])


def _swap_into_place(*, staging: Path, out_dir: Path) -> None:
    if not out_dir.exists():
        os.rename(staging, out_dir)
        return
    retired = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    os.rename(out_dir, retired)
    try:
        os.rename(staging, out_dir)
    except OSError:
        os.rename(retired, out_dir)  # put the old one back
        raise
    shutil.rmtree(retired, ignore_errors=True)
