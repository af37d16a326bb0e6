"""The planner against measurement on tiny real models (CPU, single process).

1. Parameter bytes per TP/PP rank: build a tiny transformers.LlamaForCausalLM, slice its real tensors by
   megatron's TP rules (QKV / gate / up split on the output dim, o / down on the input dim, norms replicated,
   embedding and output layer split on the vocab) and its layers by PP stage, and compare with the planner.
2. Activation bytes: sum the bytes autograd saves for backward (saved_tensors_hooks, unique storages) over one
   forward of a tiny bf16 Llama with eager attention, and compare with the planner's prediction (printed).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from toolkit.plan.assumptions import Assumptions  # noqa: E402
from toolkit.plan.layout import Layout, TrainingShape  # noqa: E402
from toolkit.plan.memory import (activation_bytes_per_layer, model_state_bytes,  # noqa: E402
                                 output_layer_activation_bytes, stage_params_per_gpu)
from toolkit.shapes import shape_from_config  # noqa: E402

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")  # split dim 0
ROW = ("o_proj", "down_proj")  # split dim 1


def _tiny_config(**overrides):
    values = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=172, vocab_size=256, tie_word_embeddings=False, max_position_embeddings=512,
                  hidden_act="silu")
    values.update(overrides)
    return transformers.LlamaConfig(**values)


def _rank_param_bytes(model, *, tp: int, tp_rank: int, pp: int, stage: int, num_layers: int) -> int:
    """Bytes of the real tensors one (tp_rank, stage) GPU holds, by megatron's sharding rules."""
    per_stage = num_layers // pp
    total = 0
    for name, tensor in model.state_dict(keep_vars=True).items():
        if ".layers." in name:
            layer = int(name.split(".layers.")[1].split(".")[0])
            if layer // per_stage != stage:
                continue
        elif "embed_tokens" in name and stage != 0:
            continue
        elif ("lm_head" in name or name == "model.norm.weight") and stage != pp - 1:
            continue
        if "embed_tokens" in name or "lm_head" in name:
            # the adapters pad the vocab to a multiple of 128 (the same for every tp), then split it
            rows = -(-tensor.shape[0] // 128) * 128
            padded = torch.nn.functional.pad(tensor.detach(), (0, 0, 0, rows - tensor.shape[0]))
            piece = padded.chunk(tp, dim=0)[tp_rank]
        elif any(k in name for k in COLUMN):
            piece = tensor.chunk(tp, dim=0)[tp_rank]
        elif any(k in name for k in ROW):
            piece = tensor.chunk(tp, dim=1)[tp_rank]
        else:
            piece = tensor  # norms are replicated
        total += piece.numel() * piece.element_size()
    return total


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (2, 2), (4, 2)])
def test_param_bytes_per_rank_match_real_tensors(tp, pp):
    config = _tiny_config(intermediate_size=176)  # divisible by 4
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    shape = shape_from_config(config.to_dict(), name="tiny-llama")
    for stage in range(pp):
        real = _rank_param_bytes(model, tp=tp, tp_rank=0, pp=pp, stage=stage, num_layers=4)
        layout = Layout(tp=tp, pp=pp, dp=1, zero_stage=0)
        predicted = model_state_bytes(num_params=stage_params_per_gpu(shape=shape, layout=layout, stage=stage),
                                      dp=1, zero_stage=0)["parameters"]
        print(f"tp={tp} pp={pp} stage {stage}: real {real} B, planner {predicted} B, ratio {predicted / real:.4f}")
        assert predicted == pytest.approx(real, rel=0.05)


def test_tied_embeddings_counted_once_at_pp1():
    config = _tiny_config(tie_word_embeddings=True, intermediate_size=176)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    shape = shape_from_config(config.to_dict(), name="tiny-tied")
    real = sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() dedupes the tie
    predicted = 2 * stage_params_per_gpu(shape=shape, layout=Layout(tp=1, pp=1, dp=1), stage=0)
    assert predicted == real


def _saved_activation_bytes(model, input_ids) -> int:
    """Bytes of the distinct storages autograd keeps for backward during one forward, parameters excluded."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_ptrs:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    return sum(storages.values())


def test_activation_bytes_against_autograd_saved_tensors():
    torch.manual_seed(0)
    seq, batch = 256, 2
    config = _tiny_config(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=688, vocab_size=512)
    config._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    input_ids = torch.randint(0, config.vocab_size, (batch, seq))
    measured = _saved_activation_bytes(model, input_ids)
    shape = shape_from_config(config.to_dict(), name="tiny-act")
    eager = Assumptions(flash_attention=False, dropout=False)
    layout = Layout(tp=1, pp=1, dp=1, micro_batch_size=batch)
    per_layer = activation_bytes_per_layer(shape=shape, seq_length=seq, micro_batch_size=batch, tp=1,
                                           sequence_parallel=False, recompute="none", assumptions=eager)
    output = output_layer_activation_bytes(shape=shape, layout=layout, training=TrainingShape(seq, batch),
                                            assumptions=eager)
    predicted = per_layer * config.num_hidden_layers + output
    ratio = predicted / measured
    print(f"activations: measured {measured / 2**20:.2f} MiB, predicted {predicted / 2**20:.2f} MiB, "
          f"predicted/measured {ratio:.3f}")
    assert 0.4 < ratio < 2.5  # loose: HF's eager Llama keeps fp32 norm internals and RoPE copies megatron fuses
