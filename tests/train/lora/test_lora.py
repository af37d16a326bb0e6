"""LoRA unit tests (toolkit/train/lora/adapters.py, export.py): targets, megatron-layout assembly, merge, counting,
init-adapter checks, Transformer Engine wiring. One process, no torch.distributed."""

from __future__ import annotations

import json
import math

import pytest
import torch

from toolkit.adapters import transforms
from toolkit.adapters.family import get_family
from toolkit.adapters.hf_config import model_settings
from toolkit.adapters.transforms import Kind
from toolkit.spec.schema import LoraSpec
from toolkit.models.tiny import tiny_config
from toolkit.train.lora import adapters as lora_mod
from toolkit.train.lora import targets as lora_targets
from toolkit.train.lora.adapters import LoraAdapter
from toolkit.train.lora.targets import LoraError, count_lora_params, module_shape, resolve_targets

LLAMA_NAMES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_default_targets_are_every_linear_module():
    assert [m.name for m in resolve_targets(get_family("llama"), None)] == LLAMA_NAMES
    assert [m.name for m in resolve_targets(get_family("phi3"), None)] == ["qkv_proj", "o_proj", "gate_up_proj",
                                                                         "down_proj"]
    gpt2 = resolve_targets(get_family("gpt2"), None)
    assert [m.hf_path for m in gpt2] == ["transformer.h.*.attn.c_attn", "transformer.h.*.attn.c_proj",
                                         "transformer.h.*.mlp.c_fc", "transformer.h.*.mlp.c_proj"]


def test_subset_targets_and_last_component_matching():
    chosen = resolve_targets(get_family("llama"), ["v_proj", "q_proj", "down_proj"])
    assert [(m.name, m.linear, m.slot) for m in chosen] == [
        ("q_proj", "self_attention.linear_qkv", 0), ("v_proj", "self_attention.linear_qkv", 2),
        ("down_proj", "mlp.linear_fc2", 0)]
    assert {m.linear for m in resolve_targets(get_family("gpt2"), ["c_proj"])} == {"self_attention.linear_proj",
                                                                                 "mlp.linear_fc2"}


def test_targets_matching_nothing_list_the_available_names():
    with pytest.raises(LoraError) as error:
        resolve_targets(get_family("llama"), ["q_proj", "query", "c_attn"])
    message = str(error.value)
    assert "['query', 'c_attn']" in message and ", ".join(LLAMA_NAMES) in message


def test_encoder_family_is_refused_by_name():
    with pytest.raises(LoraError, match="bert.*encoder"):
        resolve_targets(get_family("bert"), None)


@pytest.mark.parametrize("model_type", ["llama", "phi3", "gpt2"])
def test_count_matches_peft(model_type):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    model = AutoModelForCausalLM.from_config(config)
    targets = [m.name for m in resolve_targets(get_family(model_type), None)]
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=targets, lora_alpha=8))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert count_lora_params(config, rank=4, targets=None) == trainable


def _random_slots(settings, modules, *, rank, seed=0):
    generator = torch.Generator().manual_seed(seed)
    a, b = {}, {}
    for module in modules:
        out_features, in_features = module_shape(settings, module)
        a[module.slot] = torch.randn(rank, in_features, generator=generator, dtype=torch.float64)
        b[module.slot] = torch.randn(out_features, rank, generator=generator, dtype=torch.float64)
    return a, b


def _hf_delta_layout_free(settings, linear, modules, a, b):
    """The megatron layout-free delta made from HF-layout deltas B A, through HF storage as the weights go."""
    module0 = modules[0]
    shapes = transforms.expected_hf_shapes(module0.kind, lora_targets.linear_shape(settings, linear),
                                           ctx=settings.shape_context())
    row = next(r for r in settings.family.weights if r.megatron == f"decoder.layers.*.{linear}.weight")
    hf = []
    for slot, shape in enumerate(shapes):
        delta = b[slot] @ a[slot] if slot in a else torch.zeros(shape, dtype=torch.float64)
        stored = transforms.to_hf_storage(delta, transposed=row.transposed)  # as PEFT merges into a Conv1D
        hf.append(transforms.from_hf_storage(stored, transposed=row.transposed))
    return transforms.to_megatron(module0.kind, hf, ctx=settings.shape_context())


@pytest.mark.parametrize("model_type,targets", [("llama", None), ("llama", ["q_proj", "v_proj", "up_proj"]),
                                                ("phi3", None), ("gpt2", None)])
@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_megatron_assembly_equals_transformed_hf_delta(model_type, targets, tp_size):
    """B_local A (column) / B shard(ROW, A) (row) on each TP rank == shard(kind, to_megatron(HF deltas)); llama
    GQA at tp 4 > 2 KV heads splits groups, phi3 unpacks, gpt2 goes through Conv1D's transposed storage."""
    settings = model_settings(tiny_config(model_type))
    modules = resolve_targets(settings.family, targets)
    for linear in lora_targets.LINEARS:
        chosen = [m for m in modules if m.linear == linear]
        if not chosen:
            continue
        a, b = _random_slots(settings, chosen, rank=3)
        full = _hf_delta_layout_free(settings, linear, chosen, a, b)
        kind = chosen[0].kind
        out_rows = [s[0] for s in transforms.expected_hf_shapes(kind, lora_targets.linear_shape(settings, linear),
                                                                 ctx=settings.shape_context())]
        for tp_rank in range(tp_size):
            if lora_targets.LINEARS[linear] == "column":
                a_all, b_local = lora_mod.column_lora_matrices(kind=kind, a=a, b=b, out_rows=out_rows,
                                                               ctx=settings.shape_context(), tp_rank=tp_rank,
                                                               tp_size=tp_size)
                local = b_local @ a_all
            else:
                local = b[0] @ transforms.shard(Kind.ROW, a[0], tp_rank=tp_rank, tp_size=tp_size)
            expected = transforms.shard(kind, full, tp_rank=tp_rank, tp_size=tp_size)
            assert torch.allclose(local, expected, atol=1e-12), (model_type, linear, tp_rank)


def _adapter(settings, linear, modules, *, rank, alpha, tp_rank=0, tp_size=1):
    kind = modules[0].kind
    out_rows = [s[0] for s in transforms.expected_hf_shapes(kind, lora_targets.linear_shape(settings, linear),
                                                             ctx=settings.shape_context())]
    return LoraAdapter(linear=linear, kind=kind, modules={m.slot: m.path_for(0) for m in modules},
                       shapes={m.slot: module_shape(settings, m) for m in modules}, out_rows=out_rows, rank=rank,
                       alpha=alpha, dropout=0.0, ctx=settings.shape_context(), tp_rank=tp_rank, tp_size=tp_size,
                       sequence_parallel=False, dtype=torch.float32)


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_merge_equals_peft_merge(model_type):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config(model_type)
    settings = model_settings(config)
    modules = resolve_targets(settings.family, None)
    hf_model = AutoModelForCausalLM.from_config(config)
    original = {k: v.clone() for k, v in hf_model.state_dict().items()}
    peft_model = get_peft_model(hf_model, LoraConfig(r=4, lora_alpha=12, target_modules=sorted({m.name for m in modules}),
                                                     init_lora_weights=False))
    peft_state = peft_model.state_dict()
    merged_hf = peft_model.merge_and_unload().state_dict()
    for linear in lora_targets.LINEARS:
        chosen = [m for m in modules if m.linear == linear]
        if not chosen:
            continue
        adapter = _adapter(settings, linear, chosen, rank=4, alpha=12)
        with torch.no_grad():
            for m in chosen:
                adapter.lora_A[str(m.slot)].copy_(peft_state[f"base_model.model.{m.path_for(0)}.lora_A.default.weight"])
                adapter.lora_B[str(m.slot)].copy_(peft_state[f"base_model.model.{m.path_for(0)}.lora_B.default.weight"])
        row = next(r for r in settings.family.weights if r.megatron == f"decoder.layers.*.{linear}.weight")
        names = [n.replace("*", "0") for n in row.hf]
        weight = transforms.to_megatron(row.kind, [transforms.from_hf_storage(original[n], transposed=row.transposed)
                                                   for n in names], ctx=settings.shape_context())
        merged = transforms.to_hf(row.kind, adapter.merged_weight(weight), ctx=settings.shape_context())
        for name, tensor in zip(names, merged):
            ours = transforms.to_hf_storage(tensor, transposed=row.transposed)
            assert (ours - merged_hf[name]).abs().max() <= 1e-6, name


def _write_adapter(path, *, config: dict, tensors: dict):
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, path / "adapter_model.safetensors")


def test_init_adapter_mismatches_are_listed_together(tmp_path):
    from toolkit.train.lora.export import read_init_adapter

    settings = model_settings(tiny_config("llama", num_hidden_layers=1))
    modules = resolve_targets(settings.family, ["q_proj", "v_proj"])
    tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 2),
               "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight": torch.zeros(4, 64)}
    _write_adapter(tmp_path / "a", config={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj"],
                                           "use_dora": True}, tensors=tensors)
    with pytest.raises(LoraError) as error:
        read_init_adapter(tmp_path / "a", settings=settings, modules=modules,
                          lora=LoraSpec(rank=4, alpha=16, targets=["q_proj", "v_proj"]))
    message = str(error.value)
    for part in ("lora_alpha=8", "use_dora=True", "target_modules=['q_proj', 'k_proj']",
                 "q_proj.lora_B.weight has shape (64, 2), expected (64, 4)", "v_proj.lora_A.weight missing",
                 "k_proj.lora_A.weight in adapter_model.safetensors is not an adapter"):
        assert part in message, (part, message)
    assert "7 problem(s)" in message


class TELayerNormColumnParallelLinear(torch.nn.Module):
    """Stands in for megatron's wrapper of Transformer Engine's fused norm + column linear (same class name, same
    output contract): ((output, normalised input), None) when `return_layernorm_output`; with a bias that TE returns
    (`te_return_bias`, a family with an fc1 bias), TE's flat (output, bias, normalised input), passed on as is."""

    def __init__(self, hidden: int, out: int, *, te_return_bias: bool = False):
        super().__init__()
        self.norm = torch.nn.RMSNorm(hidden)
        self.weight = torch.nn.Parameter(torch.randn(out, hidden))
        self.bias = torch.nn.Parameter(torch.randn(out)) if te_return_bias else None
        self.te_return_bias = te_return_bias
        self.return_layernorm_output = False

    def forward(self, x):
        normed = self.norm(x)
        out = normed @ self.weight.t()
        if self.te_return_bias:
            return (out, self.bias, normed) if self.return_layernorm_output else (out, self.bias)
        return ((out, normed) if self.return_layernorm_output else out), None


@pytest.mark.parametrize("te_return_bias", [False, True], ids=["no-bias", "returned-bias"])
def test_te_layernorm_linear_feeds_the_normalised_input(monkeypatch, te_return_bias):
    from megatron.core.tensor_parallel import mappings

    monkeypatch.setattr(mappings, "copy_to_tensor_model_parallel_region", lambda x: x)
    settings = model_settings(tiny_config("llama"))
    modules = [m for m in resolve_targets(settings.family, None) if m.linear == "self_attention.linear_qkv"]
    adapter = _adapter(settings, "self_attention.linear_qkv", modules, rank=2, alpha=4)
    with torch.no_grad():
        for param in adapter.parameters():
            param.copy_(torch.randn_like(param))
    qkv_rows = lora_targets.linear_shape(settings, "self_attention.linear_qkv")[0]
    te_linear = TELayerNormColumnParallelLinear(64, qkv_rows, te_return_bias=te_return_bias)
    x = 3.0 * torch.randn(5, 2, 64)
    plain, plain_bias = te_linear(x)
    lora_mod.attach(te_linear, adapter)
    assert te_linear.return_layernorm_output and te_linear.return_layernorm_output_gathered is False
    out, bias = te_linear(x)  # the megatron contract: (output, bias), not the nested tuple
    a, b = adapter.matrices()
    expected = plain + 2.0 * te_linear.norm(x) @ a.t() @ b.t()
    assert bias is plain_bias and torch.allclose(out, expected, atol=1e-5)
    assert not torch.allclose(out, plain + 2.0 * x @ a.t() @ b.t(), atol=1e-3)  # not the raw input
    lora_mod.detach(te_linear)
    assert te_linear.return_layernorm_output is False and torch.equal(te_linear(x)[0], plain)


def test_peft_init_is_kaiming_uniform_and_layout_free():
    first, second = torch.zeros(8, 64), torch.zeros(8, 64)
    lora_mod.init_peft(first, seed=7, hf_path="model.layers.1.self_attn.q_proj")
    lora_mod.init_peft(second, seed=7, hf_path="model.layers.1.self_attn.q_proj")
    assert torch.equal(first, second) and first.abs().max() <= 1 / math.sqrt(64) and first.std() > 0.05
    other = torch.zeros(8, 64)
    lora_mod.init_peft(other, seed=7, hf_path="model.layers.2.self_attn.q_proj")
    assert not torch.equal(first, other)


def test_zero3_gathers_what_the_adapter_reads(monkeypatch):
    """ZeRO-3 gathers for a module's forward that module's own parameters: the adapter's A / B are its own (no
    child module holds them), the linear's hook runs the adapter as a module (where DeepSpeed's hooks sit), and the
    merge / export refuse a partition (the empty shard a ZeRO-3 parameter holds outside a gather)."""
    from megatron.core.tensor_parallel import mappings

    from toolkit.train.lora.export import local_adapter_state, require_whole

    monkeypatch.setattr(mappings, "copy_to_tensor_model_parallel_region", lambda x: x)
    settings = model_settings(tiny_config("llama"))
    modules = [m for m in resolve_targets(settings.family, ["q_proj", "v_proj"])]
    adapter = _adapter(settings, "self_attention.linear_qkv", modules, rank=2, alpha=4)
    assert list(adapter.children()) == [] and len(list(adapter.parameters(recurse=False))) == 4
    assert [name for name, _ in adapter.named_parameters()] == ["lora_A_0", "lora_B_0", "lora_A_2", "lora_B_2"]
    linear = TELayerNormColumnParallelLinear(64, lora_targets.linear_shape(settings, "self_attention.linear_qkv")[0])
    calls = []
    adapter.register_forward_pre_hook(lambda module, inputs: calls.append(module))
    lora_mod.attach(linear, adapter)
    linear(torch.randn(3, 64))
    assert calls == [adapter]
    require_whole(linear, what="test")  # whole tensors: nothing raised
    shard = adapter.lora_B["2"]
    shard.ds_shape, shard.data = shard.shape, torch.empty(0)  # what a partitioned parameter looks like
    layer = torch.nn.Module()
    layer.layer_number, layer.self_attention, layer.mlp = 1, torch.nn.Module(), torch.nn.Module()
    layer.self_attention.linear_qkv = linear
    chunk = type("Chunk", (), {"decoder": type("Decoder", (), {"layers": [layer]})()})()
    with pytest.raises(LoraError, match=r"LoRA adapter export: lora_B_2 holds \(0,\) of its \(\d+, 2\).*params_on_cpu"):
        local_adapter_state([chunk])


def test_lora_on_a_model_without_adapter_is_refused(tmp_path):
    """A model trained by the plain HF trainer (toolkit/train/plain/engine.py) has no megatron layers to adapt."""
    from types import SimpleNamespace

    from toolkit.errors import DsmtError
    from toolkit.train.job import run

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bloom"}))
    spec = SimpleNamespace(training=SimpleNamespace(lora=LoraSpec()))
    with pytest.raises(DsmtError, match="training.lora: model_type 'bloom' has no megatron-core adapter"):
        run._plain_parts(spec=spec, layout=None, hf_dir=tmp_path, ds_config={}, output_dir=tmp_path)


def test_init_adapter_with_trained_embeddings_is_refused_with_the_merge_as_fix(tmp_path):
    from toolkit.train.lora.export import read_init_adapter

    settings = model_settings(tiny_config("llama", num_hidden_layers=1))
    modules = resolve_targets(settings.family, ["q_proj"])
    tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 4)}
    _write_adapter(tmp_path / "a", config={"r": 4, "lora_alpha": 16, "target_modules": ["q_proj"],
                                           "modules_to_save": ["embed_tokens"]}, tensors=tensors)
    with pytest.raises(LoraError, match=r"modules_to_save=\['embed_tokens'\].*merge_and_unload"):
        read_init_adapter(tmp_path / "a", settings=settings, modules=modules,
                          lora=LoraSpec(rank=4, alpha=16, targets=["q_proj"]))


@pytest.mark.parametrize("model_type,tied,expected", [("llama", False, ["embed_tokens", "lm_head"]),
                                                      ("llama", True, ["embed_tokens"]), ("gpt2", True, ["wte"])])
def test_trained_embeddings_are_peft_modules_to_save(model_type, tied, expected):
    from toolkit.train.lora.export import peft_config

    settings = model_settings(tiny_config(model_type, tie_word_embeddings=tied))
    lora = LoraSpec(rank=4, alpha=8, train_embeddings=True)
    config = peft_config(settings=settings, modules=resolve_targets(settings.family, None), lora=lora, base_model="m")
    assert sorted(config.modules_to_save) == sorted(expected) and config.ensure_weight_tying == tied
    plain = peft_config(settings=settings, modules=resolve_targets(settings.family, None),
                        lora=LoraSpec(rank=4, alpha=8), base_model="m")
    assert plain.modules_to_save is None
