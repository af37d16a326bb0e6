"""`dsmt` command line: one sub-command per concern, each registered by its own light module.

Command modules must stay cheap to import (no torch / megatron / deepspeed at module level): `dsmt plan` and
`dsmt check` should answer in well under a second. Heavy imports happen inside the command handlers.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from toolkit.errors import DsmtError
from toolkit.launch.rank_output import VERBOSE_ENV, quiet_library_warnings, warnings_shown

# Each module defines `register(subparsers)`, which adds its sub-command(s) and sets `func` on the parser
# (`func(args) -> int`, the exit code).
COMMAND_MODULES = [
    "toolkit.convert.cli",         # dsmt convert hf-to-mcore | mcore-to-hf
    "toolkit.verify.cli",          # dsmt verify
    "toolkit.check.train_cli",     # dsmt train
    "toolkit.train.checkpoint.cli",  # dsmt checkpoint verify
    "toolkit.demo.run",            # dsmt demo
    "toolkit.check.cli",            # dsmt check, dsmt generate
    "toolkit.plan.cli",            # dsmt plan
    "toolkit.check.preflight",    # dsmt preflight
    "toolkit.launch.env_report",   # dsmt env
    "toolkit.data.cli",            # dsmt data prepare
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsmt", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if not (err.name and name.startswith(err.name)):  # a missing dependency inside it: surface it
                raise
            continue  # that concern is not built yet
        module.register(subparsers)
    return parser


def _hide_hf_progress_bars() -> None:
    """transformers' per-load bars ("Loading weights", "Writing model shards"), unless the user set the variable."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] != "1":
        return
    # huggingface_hub reads the variable once, at its import, and transformers copies hub's state at its own;
    # libraries already imported (a script or the test suite calling main) are told directly
    hub_utils = sys.modules.get("huggingface_hub.utils")
    if hub_utils is not None:
        hub_utils.disable_progress_bars()
    hf_logging = sys.modules.get("transformers.utils.logging")
    if hf_logging is not None:
        hf_logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "verbose", False):  # every rank speaks, libraries included (toolkit/launch/rank_output.py)
        os.environ[VERBOSE_ENV] = "1"
    quiet_library_warnings()  # megatron/torch fallback and deprecation noise
    if not warnings_shown():
        _hide_hf_progress_bars()
    try:
        return int(args.func(args) or 0)
    except DsmtError as err:
        print(f"dsmt {args.command}: error: {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())
