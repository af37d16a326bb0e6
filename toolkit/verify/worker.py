"""One rank of `dsmt verify`: load the sharded megatron model, run megatron's pipeline schedule forward-only on
fixed tokens, and on the last stage compare the logits with the HF model's. Launched by `toolkit.verify.run`."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

# The HF reference computes in true fp32, so the megatron side must too. Transformer Engine asks cuBLASLt for
# TF32 on every fp32 GEMM (CUBLAS_COMPUTE_32F_FAST_TF32; TE has no switch of its own), which after a few layers is
# far above verify's 1e-4; NVIDIA_TF32_OVERRIDE=0 turns TF32 off in cuBLAS and cuDNN for the whole process, TE's
# GEMMs included. The libraries read it when they start, so `toolkit.verify.run` puts it in the ranks'
# environment, and the worker sets torch's own switches (unfused attention, the HF model) as well.
TF32_OFF_ENV = {"NVIDIA_TF32_OVERRIDE": "0"}
MATH = "fp32 weights and math, TF32 off"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", type=Path, action="append", required=True, help="repeat to check several")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--vpp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--reference", type=Path, default=None, help="HF checkpoint to compare with")
    parser.add_argument("--save-as", type=Path, default=None,
                        help="also save the (first) loaded model as a dsmt megatron checkpoint written at this layout")
    parser.add_argument("--result-file", type=Path, required=True)
    return parser.parse_args(argv)


def verify_layout(*, tp: int, pp: int, vpp: int, ep: int):
    """The layout verify runs: with ep > 1 the EP ranks are ep data-parallel replicas (world = tp × pp × ep), each
    fed the same tokens, exchanging them between their experts through megatron's all-to-all dispatcher."""
    from toolkit.parallel.groups import Layout

    return Layout(tp=tp, pp=pp, vpp=vpp, ep=ep, dp=ep)


def fixed_tokens(*, batch_size: int, seq_len: int, vocab_size: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)


def fixed_inputs(*, settings, batch_size: int, seq_len: int, seed: int) -> list[dict]:
    """One micro-batch per row. Decoders: `tokens` and `position_ids`. Encoders (HF keyword inputs): the same
    random ids, token types 0 then 1 from the middle on (two segments), and row i padded over its last
    (i % 3) * seq_len // 4 positions, so that the comparison covers the padding mask (padded positions too)."""
    tokens = fixed_tokens(batch_size=batch_size, seq_len=seq_len, vocab_size=settings.vocab_size, seed=seed)
    if settings.encoder is None:
        position_ids = torch.arange(seq_len).unsqueeze(0)
        return [{"tokens": tokens[i : i + 1], "position_ids": position_ids} for i in range(batch_size)]
    token_type_ids = (torch.arange(seq_len) >= seq_len // 2).long().unsqueeze(0)
    batches = []
    for i in range(batch_size):
        attention_mask = torch.ones(1, seq_len, dtype=torch.long)
        attention_mask[:, seq_len - (i % 3) * seq_len // 4 :] = 0
        batches.append({"input_ids": tokens[i : i + 1], "attention_mask": attention_mask,
                        "token_type_ids": token_type_ids})
    return batches


def megatron_logits(*, chunks: list, micro_batches: list[dict], forward, seq_len: int,
                    device: torch.device) -> torch.Tensor | None:
    """The model's outputs on the last pipeline stage, micro-batches concatenated (None elsewhere): logits
    [batch, seq, padded_vocab], or a classifier's [batch, num_labels]. `forward(model, micro_batch)` calls the
    model (`toolkit.train.engine.tasks`); it runs on `device` (the rank's own), the outputs come back on the CPU."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    micro_batches = [{key: value.to(device) for key, value in batch.items()} for batch in micro_batches]

    def forward_step(data_iterator, model):
        output = forward(model, next(data_iterator))

        def keep_logits(output_tensor):
            return output_tensor.sum() * 0.0, {"logits": output_tensor.detach().clone()}

        return output, keep_logits

    iterators = [iter(micro_batches) for _ in chunks]
    collected = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=len(micro_batches), seq_length=seq_len,
        micro_batch_size=1, forward_only=True,
    )
    if not collected:
        return None
    return torch.cat([item["logits"] for item in collected], dim=0).cpu()


def compare(*, reference: torch.Tensor, candidate: torch.Tensor) -> dict:
    """max |Δlogit| and mean per-token KL(reference || candidate)."""
    ref_logp = torch.log_softmax(reference.double(), dim=-1)
    cand_logp = torch.log_softmax(candidate.double(), dim=-1)
    kl = (ref_logp.exp() * (ref_logp - cand_logp)).sum(-1).mean()
    return {"max_abs_diff": (reference - candidate).abs().max().item(), "kl_divergence": max(kl.item(), 0.0)}


@torch.no_grad()
def main(argv=None) -> None:
    from toolkit import backend as backends
    from toolkit.parallel.groups import destroy_process_groups, init_process_groups

    args = parse_args(argv)
    exact_fp32_math()
    backend = backends.current()
    layout = verify_layout(tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep)
    backends.use_rank_device()  # cuda:<LOCAL_RANK> before the process group (init_process_groups checks it again)
    init_process_groups(layout=layout, dist_backend=backend.dist_backend)
    results = []
    for index, checkpoint in enumerate(args.checkpoint):
        backend.seed(args.seed)
        save_as = args.save_as if index == 0 else None
        results.append(verify_checkpoint(checkpoint=checkpoint, layout=layout, args=args, save_as=save_as))
    if results[0] is not None:
        args.result_file.write_text(json.dumps(results))
    destroy_process_groups()


def exact_fp32_math() -> None:
    """TF32 off everywhere this process multiplies fp32 matrices (see TF32_OFF_ENV); before CUDA starts."""
    os.environ.update(TF32_OFF_ENV)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def verify_checkpoint(*, checkpoint: Path, layout, args, save_as: Path | None) -> dict | None:
    """Logit comparison for one checkpoint; the dict on the reporting rank (last stage, TP rank 0), else None."""
    from megatron.core import parallel_state

    from toolkit import backend as backends
    from toolkit.convert.chunks import load_model_chunks, save_mcore_checkpoint
    from toolkit.train.engine.tasks import task_for_model

    chunks, info = load_model_chunks(checkpoint=checkpoint, layout=layout, params_dtype=torch.float32,
                                     parallel_output=False)
    if save_as is not None:
        save_mcore_checkpoint(chunks=chunks, info=info, out_dir=save_as, params_dtype=torch.float32)
    for chunk in chunks:
        chunk.eval()
    inputs = fixed_inputs(settings=info.settings, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed)
    task = task_for_model(settings=info.settings)
    logits = megatron_logits(chunks=chunks, micro_batches=inputs, forward=task.forward, seq_len=args.seq_len,
                             device=backends.current().device)
    param_devices = _param_devices_by_rank(chunks)  # collective: before the non-reporting ranks return
    reporting = (parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
                 and parallel_state.get_data_parallel_rank() == 0)
    if not reporting:
        return None
    hf_dir = args.reference or (info.hf_dir if info.kind == "hf" else None)
    reference = hf_outputs(_reference_model(info, hf_dir, task.name), inputs).float()
    if task.name != "sequence_classification":  # logits over the vocabulary: the padded rows are not HF's
        logits = logits[..., : info.settings.vocab_size]
    result = compare(reference=reference, candidate=logits.float())
    result.update(checkpoint=str(checkpoint), tp=layout.tp, pp=layout.pp, vpp=layout.vpp, ep=layout.ep,
                  model_type=info.settings.family.model_type, checkpoint_kind=info.kind, task=task.name,
                  tokens=args.batch_size * args.seq_len,
                  tied_embeddings=info.settings.tied_embeddings, param_devices=param_devices,
                  math=MATH, layers=_layer_kind(chunks), window=window_note(info.settings, seq_len=args.seq_len))
    return result


def window_note(settings, *, seq_len: int) -> str | None:
    """Whether the compared length reaches past the model's sliding window (None: no window): inside it, full
    causal attention is what HF computes too, and the window itself is not exercised."""
    window_size = settings.transformer_fields.get("window_size")
    if window_size is None:
        return None
    size = window_size[0] + 1
    if seq_len <= size:
        return f"seq_len {seq_len} is inside the sliding window ({size}): full causal attention, the window unused"
    return f"seq_len {seq_len} reaches past the sliding window ({size}): the window compared"


def _layer_kind(chunks: list) -> str:
    """Which layers verify built: Transformer Engine's (where installed) or megatron's local torch layers."""
    names = {type(module).__module__ for chunk in chunks for module in chunk.modules()}
    return "transformer_engine" if any("transformer_engine" in name for name in names) else "local"


def _param_devices_by_rank(chunks: list) -> list[str]:
    """Where each rank's weights live, in rank order (["cuda:0", "cuda:1"] at TP2 on one node; "cpu" on the CPU)."""
    import torch.distributed as dist

    mine = sorted({str(p.device) for chunk in chunks for p in chunk.parameters()})
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, ",".join(mine))
    return gathered


def _reference_model(info, hf_dir, task: str):
    """The HF model the logits are compared with: the checkpoint itself, or for a dsmt megatron checkpoint, the
    HF checkpoint it was converted from (recorded in its metadata); loaded with the task's Auto class (a multimodal
    checkpoint's language model: its `...ForConditionalGeneration`)."""
    import transformers

    auto_class = {"causal_lm": transformers.AutoModelForCausalLM, "masked_lm": transformers.AutoModelForMaskedLM,
                  "sequence_classification": transformers.AutoModelForSequenceClassification}[task]
    if info.settings.family.multimodal_settings is not None:  # the multimodal class, fed input_ids only
        auto_class = transformers.AutoModelForImageTextToText
    return auto_class.from_pretrained(hf_dir or info.source_checkpoint(), dtype=torch.float32,
                                      trust_remote_code=False).eval()


def hf_outputs(model, inputs: list[dict]) -> torch.Tensor:
    """The HF model's logits on the same micro-batches (decoders: the tokens; encoders: HF's keyword inputs)."""
    batch = {key: torch.cat([item[key] for item in inputs]) for key in inputs[0]}
    if "tokens" in batch:
        return model(batch["tokens"]).logits
    return model(**batch).logits


if __name__ == "__main__":
    import sys

    from toolkit.launch.rank_output import run_rank

    sys.exit(run_rank(main, command="dsmt verify"))
