"""A checkpoint's hf/ (training.export_hf_interval, toolkit/train/job/hf_export.py), written in one gloo process
from megatron-core chunks with LoRA as the final export writes final-hf / final-hf-adapter: transformers loads it,
its tensors are the final export's, peft loads its adapter, and nothing else is left beside it. The runs that write
it at their checkpoints: tests/train/lora/test_train_lora.py (resume), tests/train/plain/test_train_plain.py."""

from __future__ import annotations

from types import SimpleNamespace

import torch


def _every_tensor(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for path in sorted(directory.glob("*.safetensors")) for k, v in load_file(path).items()}


def _export_lora_chunks(*, model_dir, tmp_path):
    """Chunks of `model_dir` with LoRA on every linear (B nonzero), exported as a checkpoint's hf/ (export: both),
    again with export: adapter, and as the run's final export."""
    from megatron.core import parallel_state

    from toolkit.convert.chunks import load_model_chunks
    from toolkit.launch.local import single_process_group
    from toolkit.parallel.groups import Layout
    from toolkit.spec.schema import LoraSpec
    from toolkit.train.job.hf_export import export_hybrid_into, export_trained
    from toolkit.train.lora.adapters import adapted_linears
    from toolkit.train.lora.apply import apply_lora

    lora = LoraSpec(rank=4, alpha=8.0)
    with single_process_group(dist_backend="gloo"):
        parallel_state.initialize_model_parallel(1, 1)
        chunks, info = load_model_chunks(checkpoint=model_dir, layout=Layout(), params_dtype=torch.float32,
                                         attention="local")
        apply_lora(chunks, settings=info.settings, lora=lora, seed=0)
        generator = torch.Generator().manual_seed(3)
        with torch.no_grad():  # B = 0 at init: the merge would change nothing
            for _, _, module in adapted_linears(chunks):
                for param in module.lora.lora_B.values():
                    param.copy_(0.05 * torch.randn(param.shape, generator=generator))
        hybrid = SimpleNamespace(chunks=chunks, engine=SimpleNamespace(module=torch.nn.ModuleList(chunks)))
        args = dict(hybrid=hybrid, info=info, precision="fp32")
        export_hybrid_into(tmp_path / "checkpoints" / "step_000004" / "hf", lora=lora, **args)
        export_hybrid_into(tmp_path / "adapter-only" / "hf", lora=lora.model_copy(update={"export": "adapter"}),
                           **args)
        export_trained(lora=lora, mcore_dir=tmp_path / "final-mcore", hf_dir=tmp_path / "final-hf",
                       adapter_dir=tmp_path / "final-hf-adapter", status_file=tmp_path / ".final.status.json", **args)


def test_a_checkpoints_hf_folder_is_the_final_export_of_the_model_as_it_is(tiny_llama, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _export_lora_chunks(model_dir=tiny_llama, tmp_path=tmp_path)
    tag, final = tmp_path / "checkpoints" / "step_000004", tmp_path / "final-hf"
    assert sorted(p.name for p in tag.iterdir()) == ["hf"]  # the megatron copy and the status file are gone
    hf = tag / "hf"
    assert {"config.json", "model.safetensors", "adapter"} <= {p.name for p in hf.iterdir()}
    assert sorted(p.name for p in (hf / "adapter").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    mine, finals = _every_tensor(hf), _every_tensor(final)
    assert sorted(mine) == sorted(finals) and all(torch.equal(mine[k], finals[k]) for k in mine)
    adapter, final_adapter = _every_tensor(hf / "adapter"), _every_tensor(tmp_path / "final-hf-adapter")
    assert sorted(adapter) == sorted(final_adapter) and all(torch.equal(adapter[k], final_adapter[k]) for k in adapter)
    original = _every_tensor(tiny_llama)
    assert any(not torch.equal(mine[k], original[k]) for k in mine)  # the merge moved the adapted weights

    tokenizer = AutoTokenizer.from_pretrained(hf)
    tokens = tokenizer("Once upon a time there was", return_tensors="pt").input_ids
    merged = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    by_peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32),
                                        hf / "adapter").eval()
    with torch.no_grad():
        gap = (merged(input_ids=tokens).logits - by_peft(input_ids=tokens).logits).abs().max().item()
    assert gap <= 1e-4, gap

    only_adapter = tmp_path / "adapter-only"  # training.lora.export: adapter: no merged model, as final-hf-adapter
    assert sorted(p.name for p in only_adapter.iterdir()) == ["hf"]
    assert sorted(p.name for p in (only_adapter / "hf").iterdir()) == ["adapter"]
    again = _every_tensor(only_adapter / "hf" / "adapter")
    assert sorted(again) == sorted(adapter) and all(torch.equal(again[k], adapter[k]) for k in again)


def test_a_plain_models_hf_folder_has_its_weights_and_the_sources_tokenizer(tiny_llama, tmp_path):
    """The plain-HF trainer's hf/ (no megatron-core adapter): save_pretrained of the model as it is, and the
    tokenizer files of the run's source, which save_pretrained does not write."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.launch.local import single_process_group
    from toolkit.train.job.hf_export import export_plain_into

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)  # trained: not the source's weights
    engine = SimpleNamespace(module=model, zero_optimization_stage=lambda: 1)  # DeepSpeed's, as export_plain uses it
    hf = tmp_path / "checkpoints" / "step_000002" / "hf"
    with single_process_group(dist_backend="gloo"):
        export_plain_into(hf, engine=engine, source_dir=tiny_llama)
    assert sorted(p.name for p in hf.parent.iterdir()) == ["hf"]
    assert (hf / "tokenizer.json").is_file() or (hf / "tokenizer_config.json").is_file()
    AutoTokenizer.from_pretrained(hf)
    loaded = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
