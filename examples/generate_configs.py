"""Sweep parallel layouts for a model on a cluster with dsmt's Python API and write one run directory per layout
that passes every check (DeepSpeed JSON, megatron settings, deepspeed / torchrun / SLURM launch scripts).

    python examples/generate_configs.py --model llama3-70b --nodes 4 --gpus-per-node 8 --gpu h100-80gb --out sweep/

--model is a built-in shape (toolkit/models/shapes.py), an HF checkpoint directory or a config.json. Layouts that
fail a rule (TP not dividing the heads, a batch that does not add up, out of memory, ...) are listed with the rule
that refused them; nothing is written for them. sweep/summary.tsv lists every layout tried.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

from toolkit import api
from toolkit.errors import DsmtError


def spec_fields(args, *, tp: int, pp: int, zero: int) -> dict:
    model = ({"path": str(args.model)} if Path(args.model).exists() else {"builtin": args.model})
    hosts = [f"node{i:02d}" for i in range(1, args.nodes + 1)] if args.nodes > 1 else None
    return {
        "model": model,
        "cluster": {"nodes": args.nodes, "gpus_per_node": args.gpus_per_node, "gpu": args.gpu, "hosts": hosts,
                    "interconnect": "infiniband" if args.nodes > 1 else "nvlink", "job_name": f"tp{tp}-pp{pp}-z{zero}"},
        "parallel": {"tp": tp, "pp": pp, "zero_stage": zero, "sequence_parallel": tp > 1},
        "training": {"global_batch_size": args.global_batch, "micro_batch_size": 1, "seq_length": args.seq_length,
                     "precision": "bf16", "recompute": "selective", "lr": 3e-4, "min_lr": 3e-5, "warmup_steps": 100,
                     "train_steps": 1000, "output_dir": str(Path(args.out).absolute() / f"tp{tp}-pp{pp}-z{zero}" / "out")},
        "data": {"synthetic": True},
    }


def sweep(args) -> list[tuple[str, str]]:
    """(label, "written" or the refusing rules) for every layout tried."""
    rows = []
    for tp, pp, zero in itertools.product(args.tp, args.pp, args.zero):
        label = f"tp{tp}-pp{pp}-z{zero}"
        try:
            spec = api.job_spec(spec_fields(args, tp=tp, pp=pp, zero=zero), source=label)
        except DsmtError as err:  # the schema refused it (SpecError carries the report)
            rows.append((label, "refused: " + ", ".join(sorted(err.report.rules())) if hasattr(err, "report")
                         else f"refused: {err}"))
            continue
        report = api.check(spec, source=label)
        if not report.ok:
            rows.append((label, "refused: " + ", ".join(sorted(report.rules()))))
            continue
        api.generate(spec, out_dir=Path(args.out) / label, overwrite=True)
        rows.append((label, "written"))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu", default="h100-80gb")
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--pp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--zero", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--out", type=Path, default=Path("sweep"))
    args = parser.parse_args(argv)
    rows = sweep(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.tsv").write_text("".join(f"{label}\t{status}\n" for label, status in rows))
    width = max(len(label) for label, _ in rows)
    for label, status in rows:
        print(f"{label:<{width}}  {status}")
    written = sum(status == "written" for _, status in rows)
    print(f"{written} of {len(rows)} layouts written to {args.out}/")
    return 0 if written else 1


if __name__ == "__main__":
    raise SystemExit(main())
