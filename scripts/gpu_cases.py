"""The GPU paths no CPU test can run, each a short `dsmt` command on one GPU (scripts/gpu_check.sh runs them all).

    python scripts/gpu_cases.py WORK_DIR             # every case; one PASS / FAIL line each; exit 1 if any failed
    python scripts/gpu_cases.py WORK_DIR --dry-run   # build every model and spec, `dsmt train --dry-run` each
                                                     # (what the CPU test of this script runs)

Cases (tiny models built on the spot, nothing downloaded; bf16 where training):
  verify-te        `dsmt verify` at TP1 with Transformer Engine's layers where installed (fp32, TF32 off in the
                   ranks: NVIDIA_TF32_OVERRIDE=0); TP2 x PP2 as well where the node has 4 GPUs or more
  bf16-packing     Llama, text data packed into sequences (THD on TE's attention, fused RoPE), bf16
  lora-llama       LoRA on TE's layer-norm linears (the normalised input returned beside the output)
  lora-gpt2        LoRA on a family with an fc1 bias: TE returns (out, bias, ln_out)
  plain-gpt-neox   a model without an adapter: DeepSpeed ZeRO only, batches and counters on the GPU
  moe-aux          Mixtral at PP = 1 with its load-balancing loss (the aux-loss scale on the loss's device)
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STORIES = REPO / "examples" / "data" / "tiny_stories.jsonl"
TIMEOUT_S = 300


def spec(*, model_dir: Path, output_dir: Path, precision: str = "bf16", training: dict | None = None,
         data: dict | None = None) -> dict:
    return {
        "model": {"path": str(model_dir)},
        "cluster": {"nodes": 1, "gpus_per_node": 1, "gpu": "h100-80gb", "device": "cuda"},
        "parallel": {"tp": 1, "pp": 1, "zero_stage": 1},
        "training": {"global_batch_size": 4, "micro_batch_size": 2, "seq_length": 128, "precision": precision,
                     "lr": 1e-4, "train_steps": 3, "warmup_steps": 0, "checkpoint_interval": 3, "log_interval": 1,
                     "output_dir": str(output_dir), **(training or {})},
        "data": {"path": str(STORIES), **(data or {})},
    }


def tiny_gpt_neox(root: Path) -> Path:
    """A causal LM without an adapter, with the tiny character tokenizer."""
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from toolkit.models.tiny import make_tiny_checkpoint

    make_tiny_checkpoint(root)  # its tokenizer files; the model is replaced
    vocab_size = json.loads((root / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=128,
                                     max_position_embeddings=256)).save_pretrained(root)
    return root


def training_cases(work: Path) -> dict[str, dict]:
    """name -> job spec; the models are written under `work`."""
    from toolkit.models.tiny import make_tiny_checkpoint

    llama = make_tiny_checkpoint(work / "models" / "llama", max_position_embeddings=256)
    gpt2 = make_tiny_checkpoint(work / "models" / "gpt2", model_type="gpt2", n_positions=256)
    mixtral = make_tiny_checkpoint(work / "models" / "mixtral", model_type="mixtral", max_position_embeddings=256,
                                   output_router_logits=True, router_aux_loss_coef=0.05)
    neox = tiny_gpt_neox(work / "models" / "gpt-neox")
    lora = {"attention": "fused", "lora": {"rank": 4, "alpha": 8}}
    return {
        "bf16-packing": spec(model_dir=llama, output_dir=work / "bf16-packing",
                             training={"attention": "fused"}, data={"packing": True}),
        "lora-llama": spec(model_dir=llama, output_dir=work / "lora-llama", training=lora),
        "lora-gpt2": spec(model_dir=gpt2, output_dir=work / "lora-gpt2", training=lora),
        "plain-gpt-neox": spec(model_dir=neox, output_dir=work / "plain-gpt-neox"),
        "moe-aux": spec(model_dir=mixtral, output_dir=work / "moe-aux", training={"attention": "fused"}),
    }


def run(command: list[str]) -> tuple[bool, str]:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=REPO)
    except subprocess.TimeoutExpired:
        return False, f"did not finish within {TIMEOUT_S} s"
    output = (done.stdout + done.stderr).strip().splitlines()
    return done.returncode == 0, (output[-1] if output else "") if done.returncode == 0 else "\n".join(output[-15:])


def losses_finite(output_dir: Path) -> tuple[bool, str]:
    lines = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = [line["loss"] for line in lines if "loss" in line]
    ok = bool(losses) and all(math.isfinite(loss) for loss in losses)
    return ok, f"losses {', '.join(f'{loss:.3f}' for loss in losses)}"


def verify_cases(work: Path, *, gpus: int) -> list[tuple[str, list[str]]]:
    from toolkit.models.tiny import make_tiny_checkpoint

    model = make_tiny_checkpoint(work / "models" / "verify-llama")
    layouts = [(1, 1)] + ([(2, 2)] if gpus >= 4 else [])
    return [(f"verify-te-tp{tp}-pp{pp}", [sys.executable, "-m", "toolkit.cli", "verify", str(model), "--tp", str(tp),
                                          "--pp", str(pp)]) for tp, pp in layouts]


def main(argv: list[str] | None = None) -> int:
    import yaml

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("work", type=Path)
    parser.add_argument("--dry-run", action="store_true", help="`dsmt train --dry-run` of every case, no GPU")
    args = parser.parse_args(argv)
    work = args.work.absolute()
    results = []
    if not args.dry_run:
        import torch

        for name, command in verify_cases(work, gpus=torch.cuda.device_count()):
            results.append((name, *run(command)))
    for name, fields in training_cases(work).items():
        path = work / f"{name}.yaml"
        path.write_text(yaml.safe_dump(fields))
        if args.dry_run:  # in this process: the checks `dsmt train --dry-run` makes, without a start-up per case
            from toolkit.check.dryrun import dry_run

            report = dry_run(path)
            ok, message = report.ok, "; ".join(p.message for p in report.problems if p.severity == "error") or "ok"
        else:
            ok, message = run([sys.executable, "-m", "toolkit.cli", "train", "--config", str(path)])
            if ok:
                ok, message = losses_finite(Path(fields["training"]["output_dir"]))
        results.append((name, ok, message))
    for name, ok, message in results:
        print(f"{'PASS' if ok else 'FAIL'} {name}: {message}", flush=True)
    return 0 if all(ok for _, ok, _ in results) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
