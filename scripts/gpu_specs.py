"""The GPU check's inputs: tiny models built on the spot (toolkit.models.tiny, nothing downloaded), their data and
the job specs of scripts/gpu_cases.py, written under WORK/models, WORK/data and WORK/specs."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
STORIES = REPO / "examples" / "data" / "tiny_stories.jsonl"
TRAIN_STEPS = 4  # checkpoints at 2 and 4: a resume from step 2 has two steps to compare
RESUME_STEP = 2
TIMING_STEPS = 20
# Where the disk cannot hold the timing run's save: the run is SIGKILLed once step TIMING_STEPS is logged, and it is
# given this many steps more (with no checkpoint before its last) so that its one save, the last step's, which dsmt
# always writes (toolkit/train/job/loop.py), lies many step times (~0.3 s each) past the runner's 0.2 s poll.
TIMING_SPARE_STEPS = 20
TIMING_MODEL = "llama3.2-1b"
# cuBLAS's fixed workspace, for run-to-run identical GEMMs (the resume's comparison). Transformer Engine's
# deterministic attention (NVTE_ALLOW_NONDETERMINISTIC_ALGO=0) is NOT asked for: the runs test the default path,
# and with it TE may find no attention backend for THD at all; the comparison allows for that (gpu_numerics).
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}

# `dsmt verify` under Transformer Engine, one launch (run_verify_many): the families whose GPU path differs from
# Llama's. Windows and the long-RoPE switch sit below verify's 32 tokens so that both are exercised.
VERIFY_FAMILIES = {
    "llama": dict(model_type="llama"),
    "qwen3": dict(model_type="qwen3", seed=5),  # q / k head norms, head_dim != hidden / heads
    "mistral-window": dict(model_type="mistral", sliding_window=8, seed=12),  # past its window of 8
    "gemma3": dict(model_type="gemma3_text", seed=16),  # local / global layers, a RoPE base each (TE's fused RoPE)
    "phi3-longrope": dict(model_type="phi3", seed=10, original_max_position_embeddings=16, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.7, 3.1, 6.4],
        "long_factor": [2.3, 4.1, 9.7, 17.5]}),  # 32 positions > 16: the long factors
    "deepseek-v2-mla": dict(model_type="deepseek_v2", seed=15),  # multi-latent attention, YaRN, shared experts
    "gpt2": dict(model_type="gpt2", seed=9),  # learned positions, LayerNorm + biases: TE's (out, bias, ln_out)
}


def write(path: Path, fields: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(fields, sort_keys=False))
    return path


def tiny(path: Path, **kwargs) -> Path:
    """A tiny checkpoint at `path`, built once (a rerun into the same WORK keeps it)."""
    from toolkit.models.tiny import make_tiny_checkpoint

    if (path / "config.json").is_file():
        return path
    return make_tiny_checkpoint(path, **kwargs)


def tiny_gpt_neox(root: Path) -> Path:
    """A causal LM without a megatron adapter (the plain DeepSpeed engine), with the tiny character tokenizer."""
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    if (root / "model.safetensors").is_file() and json.loads((root / "config.json").read_text())["model_type"] == "gpt_neox":
        return root
    tiny(root)  # its tokenizer files; the model is replaced
    vocab_size = json.loads((root / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=128,
                                     max_position_embeddings=256)).save_pretrained(root)
    return root


def short_documents(path: Path, *, stories: int = 12) -> Path:
    """The sentences of the first stories as documents (10-60 tokens): a 128-token row holds several, so packing
    puts records side by side (tests/train/job/test_train_packing.py builds the same)."""
    texts = [json.loads(line)["text"] for line in STORIES.read_text().splitlines()[:stories]]
    documents = [sentence.strip() + "." for text in texts for sentence in text.split(".") if sentence.strip()]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": document}) + "\n" for document in documents))
    return path


def models(work: Path) -> dict[str, Path]:
    root = work / "models"
    return {"llama": tiny(root / "llama", max_position_embeddings=256),
            "gpt2": tiny(root / "gpt2", model_type="gpt2", n_positions=256, seed=3),
            "mixtral": tiny(root / "mixtral", model_type="mixtral", max_position_embeddings=256,
                            output_router_logits=True, router_aux_loss_coef=0.05),
            "gpt-neox": tiny_gpt_neox(root / "gpt-neox")}


def verify_models(work: Path) -> list[Path]:
    return [tiny(work / "models" / "verify" / name, **kwargs) for name, kwargs in VERIFY_FAMILIES.items()]


def peft_adapter(model_dir: Path, out_dir: Path, *, seed: int) -> Path:
    """PEFT's own adapter with B != 0 on every linear dsmt adapts (tests/train/train_helpers.py), so every LoRA
    matrix has a gradient at step 1."""
    import sys

    if (out_dir / "adapter_config.json").is_file():
        return out_dir
    sys.path.insert(0, str(REPO / "tests" / "train"))
    try:
        from train_helpers import write_peft_adapter
    finally:
        sys.path.remove(str(REPO / "tests" / "train"))
    return write_peft_adapter(model_dir, out_dir, rank=4, alpha=8.0, targets=None, seed=seed, b_scale=0.05)


def spec(*, model_dir: Path, output_dir: Path, precision: str = "bf16", zero_stage: int = 1, training: dict | None = None,
         data: dict | None = None) -> dict:
    """One GPU, the tiny model, 4 steps of 2 micro-batches (global batch 4), checkpoints at steps 2 and 4. Every
    value a comparison depends on is written out (the HF + PEFT reference reads them from the YAML).

    fp32 on Transformer Engine's attention (`fused`) is unpacked (data.packing: false): the packer gives the
    padding at a row's end a segment of its own, so packed micro-batches take TE's THD layout, for which TE has
    no fp32 attention (its unfused backend refuses THD; flash and cuDNN take fp16 / bf16 only), and `dsmt check`
    refuses the combination (packing_fused_fp32). Unpacked rows keep their positions running: no THD."""
    attention = (training or {}).get("attention", "fused")
    unpacked = {"packing": False} if precision == "fp32" and attention in ("fused", "auto") else {}  # auto: cuda
    return {
        "model": {"path": str(model_dir)},
        "cluster": {"nodes": 1, "gpus_per_node": 1, "gpu": "h100-80gb", "device": "cuda"},
        "parallel": {"tp": 1, "pp": 1, "zero_stage": zero_stage},
        "training": {"global_batch_size": 4, "micro_batch_size": 2, "seq_length": 128, "precision": precision,
                     "attention": "fused", "lr": 1e-3, "min_lr": 1e-4, "lr_schedule": "cosine", "warmup_steps": 0,
                     "weight_decay": 0.1, "grad_clip": 1.0, "train_steps": TRAIN_STEPS,
                     "checkpoint_interval": RESUME_STEP, "log_interval": 1, "seed": 1234,
                     "output_dir": str(output_dir), **(training or {})},
        "data": {"path": str(STORIES), "shuffle": True, **unpacked, **(data or {})},
    }


def lora_spec(*, model_dir: Path, adapter: Path, output_dir: Path, precision: str) -> dict:
    """LoRA from PEFT's adapter at a constant rate (warmup 0), clipped at 1.0 as the reference clips: what
    tests/train/reference_lora.py reproduces with HF + PEFT. Two steps: step 1's loss and (pre-clip) gradient
    norm, then step 2's loss, after one update."""
    lora = {"rank": 4, "alpha": 8.0, "init_adapter": str(adapter)}
    return spec(model_dir=model_dir, output_dir=output_dir, precision=precision,
                training={"lr": 2e-3, "min_lr": 2e-3, "lr_schedule": "constant", "train_steps": 2,
                          "checkpoint_interval": 2, "lora": lora})


def api_spec(*, model_dir: Path, output_dir: Path, attention: str) -> dict:
    """toolkit.api.initialize's spec: the script brings its batches (the data section is only checked)."""
    fields = spec(model_dir=model_dir, output_dir=output_dir, training={"seq_length": 64, "attention": attention})
    fields["training"]["train_steps"] = 2
    return fields


def gpu_preset() -> str:
    """The planner's preset for GPU 0 (its peak FLOPs are the MFU denominator of the timing report)."""
    import torch

    if not torch.cuda.is_available():  # the runs will say so themselves
        return "h100-80gb"
    properties = torch.cuda.get_device_properties(0)
    name = properties.name.upper()
    if "H200" in name:
        return "h200-141gb"
    if "A100" in name:
        return "a100-80gb" if properties.total_memory > 50e9 else "a100-40gb"
    return "h100-80gb"


def timing_spec(*, output_dir: Path, gpu: str, save: bool = True) -> dict:
    """20 bf16 steps of the llama3.2-1b shape on synthetic tokens (megatron init, nothing downloaded: synthetic
    data reads no tokenizer), one GPU: the step time, MFU and memory against the planner's prediction.

    `save`: the run ends at step 20 with its checkpoint and export. Without: it is to be SIGKILLed once step 20 is
    logged (scripts/gpu_cases.py), before any save. dsmt always saves the last step, so the run is given
    TIMING_SPARE_STEPS steps more, and a checkpoint_interval past its end (no save inside it but the last's)."""
    steps = TIMING_STEPS if save else TIMING_STEPS + TIMING_SPARE_STEPS
    return {"model": {"builtin": TIMING_MODEL},
            "cluster": {"nodes": 1, "gpus_per_node": 1, "gpu": gpu, "device": "cuda"},
            "parallel": {"tp": 1, "pp": 1, "zero_stage": 1},
            "training": {"precision": "bf16", "seq_length": 2048, "micro_batch_size": 4, "global_batch_size": 8,
                         "train_steps": steps, "warmup_steps": 2,
                         "checkpoint_interval": steps if save else steps + 1, "log_interval": 5,
                         "output_dir": str(output_dir)},
            "data": {"synthetic": True}}


def timing_params() -> int:
    from toolkit.models.shapes import BUILTIN_SHAPES

    return BUILTIN_SHAPES[TIMING_MODEL].num_params()
