"""The built chunks carry what DeepSpeed needs to treat TP shards as shards (one process, TP1)."""

import torch

from toolkit.adapters.build import build_model_chunks
from toolkit.adapters.hf_config import load_hf_config, model_settings
from toolkit.launch.local import single_process_group
from toolkit.parallel.groups import Layout


def test_every_tp_sharded_weight_is_marked_with_its_partition_dim(tiny_checkpoints):
    """Weights come from the checkpoint, so megatron skips its random init, and with it the attributes that tell
    DeepSpeed's grad norm and bf16 optimizer which parameters are split over TP (a missing mark made the TP2 grad
    norm wrong and bf16 TP2 crash)."""
    from megatron.core import parallel_state

    settings = model_settings(load_hf_config(tiny_checkpoints["qwen2"]))  # qwen2: the qkv bias too
    with single_process_group(dist_backend="gloo"):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        (chunk,) = build_model_chunks(settings=settings, layout=Layout())
        marks = {name: (getattr(p, "tensor_model_parallel", False), getattr(p, "partition_dim", None))
                 for name, p in chunk.named_parameters()}
    expected = {"embedding.word_embeddings.weight": (True, 0), "output_layer.weight": (True, 0),
                "decoder.layers.0.self_attention.linear_qkv.weight": (True, 0),
                "decoder.layers.0.self_attention.linear_qkv.bias": (True, 0),
                "decoder.layers.0.self_attention.linear_proj.weight": (True, 1),
                "decoder.layers.0.mlp.linear_fc1.weight": (True, 0),
                "decoder.layers.0.mlp.linear_fc2.weight": (True, 1)}
    for name, mark in expected.items():
        assert marks[name] == mark, name
    norms = [name for name in marks if "layernorm" in name or "final_layernorm" in name]
    assert norms and all(not marks[name][0] for name in norms), {n: marks[n] for n in norms}


def test_marking_keeps_attributes_megatron_already_set(tiny_checkpoints):
    from megatron.core import parallel_state

    settings = model_settings(load_hf_config(tiny_checkpoints["llama"]))
    with single_process_group(dist_backend="gloo"):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        torch.manual_seed(0)
        (chunk,) = build_model_chunks(settings=settings, layout=Layout(), init_weights=True)  # megatron marks these
        assert chunk.decoder.layers[0].mlp.linear_fc2.weight.partition_dim == 1


def test_the_padded_vocabulary_is_minus_infinity_after_every_output_hook(tmp_path):
    """The output layer's last hook sets the padded vocabulary's logits to -inf (toolkit/adapters/vocab_mask.py):
    after Gemma 2's softcap too, which maps -inf to -cap when it runs after the mask."""
    from megatron.core import parallel_state

    from toolkit import backend as backends
    from toolkit.convert.chunks import load_model_chunks
    from toolkit.models.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "gemma2", model_type="gemma2")  # vocab 250 -> 256, final softcap
    with single_process_group(dist_backend="gloo"):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        backends.current().seed(0)
        (model,), info = load_model_chunks(checkpoint=path, layout=Layout(), params_dtype=torch.float32)
        assert info.settings.padded_vocab_size > info.settings.vocab_size
        assert info.settings.quirks.get("final_logit_softcapping")
        tokens = torch.arange(16).view(1, 16)  # one row: GPTModel's output is a view of the output layer's
        logits = model(tokens, torch.arange(16).view(1, 16), None)
    vocab = info.settings.vocab_size
    assert torch.isinf(logits[..., vocab:]).all() and (logits[..., vocab:] < 0).all()
    assert torch.isfinite(logits[..., :vocab]).all()
