"""`dsmt check JOB...` and `dsmt generate JOB --out DIR [--templates TDIR]`: the job spec's two commands."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from toolkit.errors import SpecError


def register(subparsers) -> None:
    check = subparsers.add_parser("check", help="pre-flight checks of job specs: every problem at once, with fixes")
    check.add_argument("specs", nargs="+", metavar="JOB", help="job spec files (YAML or JSON)")
    _add_set(check)
    check.add_argument("--deep", action="store_true",
                       help="also what `dsmt train` checks before it starts a rank (the same as `dsmt train "
                            "--dry-run`): the model built at this layout on the meta device, DeepSpeed's parse of "
                            "the config, the tokenizer against the vocabulary; and every Megatron corpus read whole "
                            "against the digests `dsmt data prepare` recorded (~0.3 s per GB from the page cache)")
    check.add_argument("--json", action="store_true", help="print a machine-readable report")
    check.set_defaults(func=run_check)

    generate = subparsers.add_parser("generate", help="write ds_config.json, megatron.json, hostfile, launch scripts")
    generate.add_argument("spec", metavar="JOB", help="job spec file (YAML or JSON)")
    generate.add_argument("--out", required=True, type=Path, help="run directory to create")
    generate.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    generate.add_argument("--templates", type=Path, default=None, metavar="TDIR",
                          help="a directory of site copies of launch/'s templates (launch_deepspeed.sh, "
                               "launch_torchrun.sh, job.sbatch, deepspeed_env): each replaces the shipped one")
    _add_set(generate)
    generate.set_defaults(func=run_generate)


def _add_set(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a spec value (parsed as YAML), e.g. --set parallel.tp=4; repeatable")


def run_check(args: argparse.Namespace) -> int:
    from toolkit.check.checks import check_file

    if args.deep:
        reports = [_deep_report(path, overrides=args.overrides) for path in args.specs]
    else:
        reports = [check_file(path, overrides=args.overrides)[1] for path in args.specs]
    if args.json:
        print(json.dumps([r.to_json() for r in reports], indent=2))
    else:
        print("\n".join(r.to_text() for r in reports))
    return 0 if all(r.ok for r in reports) else SpecError.exit_code  # bad input: 2, as every dsmt refusal


def _deep_report(path: str, *, overrides: list[str]):
    """The dry run's report, plus the corpora's digests: not in the dry run, which `dsmt train` runs before every
    launch (the ranks check the digests in the background there)."""
    import dataclasses

    from toolkit.check.data_checks import corpus_digest_problems
    from toolkit.check.dryrun import prelaunch

    spec, report = prelaunch(path, overrides=overrides)
    if spec is None:
        return report
    return dataclasses.replace(report, problems=(*report.problems, *corpus_digest_problems(data=spec.data)))


def run_generate(args: argparse.Namespace) -> int:
    from toolkit.check.job import check_job
    from toolkit.generate.templates import load_templates
    from toolkit.generate.writer import write_run_dir
    from toolkit.spec.load import absolutize_paths, load_spec

    templates = load_templates(site_dir=args.templates)
    try:
        spec = load_spec(args.spec, overrides=args.overrides)
        # the run directory's copy must not depend on the cwd
        job = check_job(absolutize_paths(spec, base_dir=Path.cwd()), source=str(args.spec))
    except SpecError as err:
        print(err.report.to_text(), file=sys.stderr)
        return SpecError.exit_code
    written = write_run_dir(job=job, out_dir=args.out, overwrite=args.overwrite, templates=templates)
    source = f" (templates: {templates.describe()})" if args.templates is not None else ""
    print(f"dsmt generate: wrote {len(written)} files to {args.out}{source}")
    for path in written:
        print(f"  {path.name}")
    print((args.out / "summary.txt").read_text(), end="")
    return 0
