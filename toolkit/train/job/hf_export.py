"""The trained model as transformers loads it: a run's final export (final-hf, final-mcore, final-hf-adapter) and a
checkpoint's hf/ every `training.export_hf_interval` steps (`TrainParts.export_into`, toolkit/train/job/loop.py)."""

from __future__ import annotations

from pathlib import Path

import torch

ADAPTER_DIR = "adapter"  # a checkpoint's hf/adapter: the PEFT adapter when training.lora.export writes one
SCRATCH_MCORE = ".hf-mcore"  # beside hf/ while it is written: the megatron checkpoint hf/ is streamed from
SCRATCH_STATUS = ".hf-export.status.json"


def export_trained(*, hybrid, info, precision: str, lora, mcore_dir: Path, hf_dir: Path, adapter_dir: Path,
                   status_file: Path) -> None:
    """Trained weights -> dsmt megatron checkpoint `mcore_dir`, saved collectively (every rank writes its own
    shards; ZeRO-3 parameters are gathered one at a time into CPU copies) -> HF directory `hf_dir`, streamed tensor
    by tensor from that checkpoint by rank 0 while the other ranks wait on its status file: liveness-checked, no
    collective timeout a long export could outlast, and a failure on rank 0 raises on every rank. Tensors the model
    does not load (`ModelSettings.passthrough_hf`) are copied unchanged from the run's source into both. With LoRA, the
    merge and the PEFT adapter (`adapter_dir`) also read the gathered CPU copies (base weights and adapters are
    partitioned at ZeRO-3); `lora.export` says which of the merged model and the adapter are written. What is
    written replaces its directory; what is not is removed (an earlier export of the run)."""
    import contextlib
    import shutil

    from toolkit.convert.mcore_to_hf import convert_mcore_to_hf
    from toolkit.convert.passthrough import keep_source_passthrough
    from toolkit.launch.rank0 import on_rank0
    from toolkit.convert.chunks import save_mcore_checkpoint
    from toolkit.train.lora.adapters import adapted_linears
    from toolkit.train.lora.export import gather_peft_adapter, merged_lora, write_peft_adapter
    from toolkit.adapters.zero3 import params_on_cpu

    merged = lora is None or lora.export != "adapter"  # training.lora.export: adapter | merged | both
    with_adapter = lora is not None and lora.export != "merged"
    adapter = None
    # the adapter alone reads only the adapters: at ZeRO-3 the frozen base stays partitioned (a whole CPU copy of a
    # 30B MoE per rank is what export: adapter avoids)
    gathered = hybrid.engine.module if merged else torch.nn.ModuleList(
        module.lora for _, _, module in adapted_linears(hybrid.chunks))
    with params_on_cpu(gathered):
        if merged:  # LoRA: the exports get W + scaling * B A (merged into copies: the engine keeps the adapters)
            with merged_lora(hybrid.chunks) if lora is not None else contextlib.nullcontext():
                save_mcore_checkpoint(chunks=hybrid.chunks, info=info, out_dir=mcore_dir,
                                      params_dtype=params_dtype(precision), overwrite=True)
        if with_adapter:  # PEFT's files, for PeftModel.from_pretrained(original model, adapter_dir)
            adapter = gather_peft_adapter(hybrid.chunks, settings=info.settings, lora=lora)

    def export(progress) -> str:
        # an earlier export of this run that this one does not write would stand beside it as if it were current
        for stale in ([] if merged else [hf_dir, mcore_dir]) + ([] if with_adapter or lora is None else [adapter_dir]):
            shutil.rmtree(stale, ignore_errors=True)
        line = ""
        if merged:
            # Tensors the model does not load (multi-token prediction) go out as the run's source had them.
            keep_source_passthrough(kind=info.kind, hf_dir=info.hf_dir, patterns=info.settings.passthrough_hf,
                                    mcore_dir=mcore_dir)
            line = convert_mcore_to_hf(mcore_dir=mcore_dir, out_dir=hf_dir, overwrite=True, progress=progress).line()
        if with_adapter:  # after the HF export: trained embeddings are read from it
            write_peft_adapter(adapter, settings=info.settings, lora=lora, out_dir=adapter_dir,
                               base_model=info.source_checkpoint(), hf_dir=hf_dir)
            line = line or f"PEFT adapter written to {adapter_dir} (training.lora.export: adapter, no merged copy)"
        return line

    on_rank0(export, status_file=status_file, what=f"export of {hf_dir if merged else adapter_dir}")


def export_hybrid_into(hf_dir: Path, *, hybrid, info, precision: str, lora) -> None:
    """Collective: the megatron-core model as it is now into `hf_dir` (a checkpoint's hf/), as the final export
    writes final-hf: the merged model (LoRA merged in) and, as `lora.export` says, the PEFT adapter in
    `hf_dir`/adapter (export: adapter writes that alone). The megatron checkpoint it is streamed from, and the
    export's status file, are written beside `hf_dir` and removed once every rank is past the export, so the
    folder that holds `hf_dir` gains hf/ only."""
    import torch.distributed as dist

    hf_dir = Path(hf_dir)
    scratch, status_file = hf_dir.parent / SCRATCH_MCORE, hf_dir.parent / SCRATCH_STATUS
    export_trained(hybrid=hybrid, info=info, precision=precision, lora=lora, mcore_dir=scratch, hf_dir=hf_dir,
                   adapter_dir=hf_dir / ADAPTER_DIR, status_file=status_file)
    dist.barrier()  # every rank has read the status file: it and the megatron copy can go
    _on_rank0_remove(scratch, status_file, what=f"removing the scratch files of {hf_dir}")


def export_plain_into(hf_dir: Path, *, engine, source_dir: Path) -> None:
    """Collective: a plain HF model (toolkit/train/plain/engine.py) as it is now into `hf_dir` with save_pretrained
    (gathered under ZeRO-3), and the tokenizer / processor files of `source_dir` that save_pretrained does not write
    (the config it writes is the model's own)."""
    from toolkit.train.plain.engine import export_plain

    hf_dir, source_dir = Path(hf_dir), Path(source_dir)
    export_plain(engine=engine, out_dir=hf_dir)

    def copy_side_files() -> None:
        import shutil

        from toolkit.convert.checkpoint import side_files

        for name in side_files(source_dir):
            if not (hf_dir / name).exists():
                shutil.copy2(source_dir / name, hf_dir / name)

    from toolkit.launch.rank0 import on_rank0

    on_rank0(copy_side_files, what=f"copying the tokenizer files of {source_dir} into {hf_dir}")


def _on_rank0_remove(*paths: Path, what: str) -> None:
    """Collective: rank 0 removes `paths` (folders or files; absent ones are fine), every rank returns after."""
    import shutil

    from toolkit.launch.rank0 import on_rank0

    def remove() -> None:
        for path in paths:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)

    on_rank0(remove, what=what)


def params_dtype(precision: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
