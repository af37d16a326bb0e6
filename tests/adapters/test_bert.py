"""BERT on megatron-core, one process: the table, the post-LN encoder against HF's outputs, the bit-exact round trip
and the refusals. Layouts with several ranks are in test_bert_multiproc.py."""

import json

import pytest
import torch

from toolkit.adapters.family import AdapterError, expand_table
from toolkit.adapters.hf_config import load_hf_config, model_settings
from toolkit.adapters.load import check_hf_coverage
from toolkit.demo.tiny_encoder import TINY_BERT, TINY_BERT_HEADS, make_tiny_bert

HEADS = TINY_BERT_HEADS


@pytest.fixture(scope="module")
def tiny_berts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-bert")
    return {name: make_tiny_bert(root / name, **kwargs) for name, kwargs in HEADS.items()}


def encoder_inputs(*, batch_size=3, seq_len=12, seed=1) -> dict:
    """Random ids and token types, and padding at the end of rows 1 and 2 (padded positions included in the
    comparison: their outputs depend on the mask semantics)."""
    generator = torch.Generator().manual_seed(seed)
    attention_mask = torch.ones(batch_size, seq_len, dtype=torch.long)
    attention_mask[1, 8:] = 0
    attention_mask[2, 5:] = 0
    return {"input_ids": torch.randint(0, TINY_BERT["vocab_size"], (batch_size, seq_len), generator=generator),
            "attention_mask": attention_mask,
            "token_type_ids": torch.randint(0, 2, (batch_size, seq_len), generator=generator)}


@pytest.mark.parametrize("name", list(HEADS))
def test_table_covers_every_hf_tensor_both_ways(name, tiny_berts):
    from safetensors import safe_open

    settings = model_settings(load_hf_config(tiny_berts[name]))
    with safe_open(tiny_berts[name] / "model.safetensors", "pt") as handle:
        hf_names = list(handle.keys())
    items = expand_table(settings.weight_table(), num_layers=settings.num_layers)
    assert check_hf_coverage(items=items, hf_names=hf_names, ignored=settings.ignored_hf()) == []
    heads = {"mlm": "lm_head.dense.weight", "regression": "classifier.weight", "classes3": "classifier.weight"}
    assert heads[name] in items and ("output_layer.bias" in items) == (name == "mlm")
    assert settings.tied_embeddings == (name == "mlm")  # a classifier has no output layer to tie


def test_config_translation():
    from transformers import BertConfig

    settings = model_settings(BertConfig(**{**TINY_BERT, "hidden_dropout_prob": 0.1}, num_labels=3,
                                         architectures=["BertForSequenceClassification"], classifier_dropout=0.2))
    fields = settings.transformer_fields
    assert (fields["normalization"], fields["gated_linear_unit"], fields["add_bias_linear"]) == \
        ("LayerNorm", False, True)
    assert fields["activation_func"] is torch.nn.functional.gelu and fields["layernorm_epsilon"] == 1e-12
    assert fields["num_query_groups"] == 4 and fields["hidden_dropout"] == 0.1
    assert (settings.encoder.task, settings.encoder.num_labels, settings.encoder.num_tokentypes,
            settings.encoder.classifier_dropout) == ("sequence_classification", 3, 2, 0.2)


@pytest.mark.parametrize("fields,fragment", [
    (dict(architectures=["BertForTokenClassification"]),
     "no such head; supported: BertForMaskedLM, BertForSequenceClassification"),
    (dict(architectures=["BertForMaskedLM"], tie_word_embeddings=False), "tie_word_embeddings=False"),
    (dict(architectures=["BertForMaskedLM"], hidden_act="relu"), "hidden_act='relu'"),
    (dict(architectures=["BertForMaskedLM"], is_decoder=True), "is_decoder"),
])
def test_unsupported_configs_are_named(fields, fragment):
    from transformers import BertConfig

    with pytest.raises(AdapterError, match=None) as err:
        model_settings(BertConfig(**{**TINY_BERT, **fields}))
    assert fragment in str(err.value)


def test_fused_attention_and_context_parallelism_refused():
    from toolkit.adapters.encoder import check_encoder_attention

    check_encoder_attention(attention="local", cp_size=1)
    check_encoder_attention(attention=None, cp_size=1)
    for attention, cp in (("fused", 1), ("local", 2)):
        with pytest.raises(AdapterError, match="set training.attention: local and parallel.cp: 1"):
            check_encoder_attention(attention=attention, cp_size=cp)


def megatron_outputs(checkpoint, inputs: dict) -> torch.Tensor:
    """The megatron model's output at TP1 / PP1 in this process (logits: the padded vocabulary cut off)."""
    from megatron.core import parallel_state

    from toolkit import backend as backends
    from toolkit.launch.local import single_process_group
    from toolkit.convert.chunks import load_model_chunks
    from toolkit.parallel.groups import Layout

    with single_process_group(dist_backend="gloo"):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        backends.current().seed(0)
        (model,), info = load_model_chunks(checkpoint=checkpoint, layout=Layout(), params_dtype=torch.float32,
                                           parallel_output=False)
        model.eval()
        with torch.no_grad():
            output = model(inputs["input_ids"], inputs["attention_mask"], inputs["token_type_ids"])
    return output[..., : info.settings.vocab_size] if output.dim() == 3 else output


@pytest.mark.parametrize("name", list(HEADS))
def test_outputs_equal_hf_with_padding_and_token_types(name, tiny_berts):
    """Every position, padded ones too (megatron's BertModel masks padded queries' rows, HF does not: this encoder
    follows HF). Measured: MLM logits 2.4e-7, classifier outputs <= 1.2e-7."""
    import transformers

    inputs = encoder_inputs()
    architecture = HEADS[name]["architecture"]
    hf = getattr(transformers, architecture).from_pretrained(tiny_berts[name], dtype=torch.float32).eval()
    with torch.no_grad():
        reference = hf(**inputs).logits
    output = megatron_outputs(tiny_berts[name], inputs)
    assert output.shape == reference.shape
    print(name, "max |Δ|", (output - reference).abs().max().item())
    assert (output - reference).abs().max().item() < 1e-5
    assert reference.abs().max() > 0.1  # not two zeros


@pytest.mark.parametrize("name", ["mlm", "classes3"])
def test_gradients_equal_hf_for_every_parameter(name, tiny_berts):
    """Backward parity through the weight table: every megatron gradient equals its HF gradient(s) made into the
    megatron layout. The inputs put the pad id at real positions (as the MLM collator's random replacement may):
    HF's pad row gets no gradient from those lookups (nn.Embedding padding_idx), and neither may megatron's.
    Measured: <= 6.4e-7 of each gradient's largest entry (without the padding_idx rule: 0.87)."""
    import transformers
    from megatron.core import parallel_state

    from toolkit import backend as backends
    from toolkit.adapters import transforms
    from toolkit.adapters.load import canonical_parameters
    from toolkit.launch.local import single_process_group
    from toolkit.convert.chunks import load_model_chunks
    from toolkit.parallel.groups import Layout

    inputs = encoder_inputs()
    inputs["input_ids"][:, 3] = 0  # [PAD] looked up at a real position
    hf = getattr(transformers, HEADS[name]["architecture"]).from_pretrained(tiny_berts[name], dtype=torch.float32)
    weights = torch.randn(hf(**inputs).logits.shape, generator=torch.Generator().manual_seed(3))
    (hf(**inputs).logits * weights).sum().backward()
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    hf_grads.setdefault("cls.predictions.bias", hf.state_dict().get("cls.predictions.bias"))
    with single_process_group(dist_backend="gloo"):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        backends.current().seed(0)  # megatron's RNG tracker, which its training-mode forward asks for
        (model,), info = load_model_chunks(checkpoint=tiny_berts[name], layout=Layout(), params_dtype=torch.float32,
                                           parallel_output=False)
        output = model(inputs["input_ids"], inputs["attention_mask"], inputs["token_type_ids"])
        (output[..., : info.settings.vocab_size] * weights).sum().backward()
        params = canonical_parameters([model])
    ctx = info.settings.shape_context()
    items = expand_table(info.settings.weight_table(), num_layers=info.settings.num_layers)
    diffs = {}  # |Δ| relative to the gradient's largest entry
    for megatron_name, item in items.items():
        expected = transforms.to_megatron(item.kind, [hf_grads[n] for n in item.hf], ctx=ctx)
        diffs[megatron_name] = ((params[megatron_name].grad - expected).abs().max() / expected.abs().max()).item()
    print(name, "largest relative gradient difference", max(diffs.values()))
    assert max(diffs.values()) < 1e-5, {k: v for k, v in diffs.items() if v >= 1e-5}
    assert hf.bert.embeddings.word_embeddings.weight.grad.abs().max() > 0.1


def test_embedding_norm_runs_before_dropout(tiny_berts):
    """HF: LayerNorm(word + position + type) then dropout; the norm is a pre-hook of megatron's dropout module."""
    from megatron.core import parallel_state

    from toolkit.launch.local import single_process_group
    from toolkit.convert.chunks import load_model_chunks
    from toolkit.parallel.groups import Layout

    with single_process_group(dist_backend="gloo"):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        (model,), _ = load_model_chunks(checkpoint=tiny_berts["mlm"], layout=Layout(), params_dtype=torch.float32)
        seen = []
        model.embedding.embedding_dropout.register_forward_hook(lambda module, args, out: seen.append(args[0]))
        inputs = encoder_inputs()
        model.embedding(input_ids=inputs["input_ids"], position_ids=torch.arange(12).expand(3, 12),
                        tokentype_ids=inputs["token_type_ids"])
    norm = model.embedding.layer_norm
    centred = (seen[0] - norm.bias) / norm.weight  # undo the affine part: what remains is normalised
    assert centred.mean(-1).abs().max() < 1e-4 and (centred.var(-1, unbiased=False) - 1).abs().max() < 1e-3


@pytest.mark.parametrize("name", ["mlm", "regression"])
def test_round_trip_is_bit_exact_and_loads_in_transformers(name, tiny_berts, tmp_path):
    import transformers
    from safetensors.torch import load_file

    from toolkit.cli import main as dsmt

    source = tiny_berts[name]
    assert dsmt(["convert", "hf-to-mcore", str(source), str(tmp_path / "mcore")]) == 0
    assert dsmt(["convert", "mcore-to-hf", str(tmp_path / "mcore"), str(tmp_path / "back")]) == 0
    original, exported = load_file(source / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(original[k], exported[k]) and original[k].dtype == exported[k].dtype for k in original)
    architecture = json.loads((tmp_path / "back" / "config.json").read_text())["architectures"][0]
    assert architecture == HEADS[name]["architecture"]
    auto = {"mlm": transformers.AutoModelForMaskedLM, "regression": transformers.AutoModelForSequenceClassification}
    reloaded = auto[name].from_pretrained(tmp_path / "back").eval()
    inputs = encoder_inputs()
    with torch.no_grad():
        reference = getattr(transformers, architecture).from_pretrained(source).eval()(**inputs).logits
        assert torch.equal(reloaded(**inputs).logits, reference)


def test_dsmt_check_names_encoder_problems(tiny_berts, tmp_path):
    """`dsmt check`: fused attention, synthetic data and a head without a table are refused before launch."""
    from toolkit import api

    def rules(model_dir, **sections) -> dict:
        fields = {"model": {"path": str(model_dir)},
                  "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu": "cpu", "device": "cpu", "interconnect": "tcp"},
                  "parallel": {"tp": 2}, "training": {"global_batch_size": 4, "micro_batch_size": 2,
                                                       "seq_length": 32, "output_dir": str(tmp_path / "out")},
                  "data": {"path": str(tmp_path / "records.jsonl")}}
        for section, values in sections.items():
            fields[section] = {**fields[section], **values}
        return {p.rule: p for p in api.check(api.job_spec(fields)).problems if p.severity == "error"}

    assert not {"encoder_layers", "encoder_synthetic_data", "encoder_head"} & set(rules(tiny_berts["regression"]))
    fused = rules(tiny_berts["regression"], training={"attention": "fused"})["encoder_layers"]
    assert "set training.attention: local and parallel.cp: 1" in fused.fix
    # On GPUs training.attention: auto is Transformer Engine's fused attention for decoders, local for encoders
    from toolkit.spec.layout import spec_attention

    on_gpus = {"cluster": {"nodes": 1, "gpus_per_node": 2, "gpu": "h100-80gb", "device": "cuda"},
               "training": {"global_batch_size": 4, "micro_batch_size": 2, "seq_length": 32, "precision": "bf16",
                            "output_dir": str(tmp_path / "out")}, "data": {"path": str(tmp_path / "records.jsonl")}}
    assert spec_attention(api.job_spec({"model": {"path": str(tiny_berts["regression"])}, **on_gpus})) == "local"
    assert spec_attention(api.job_spec({"model": {"builtin": "llama3-8b"}, **on_gpus})) == "fused"
    assert "encoder_layers" not in rules(tiny_berts["regression"], **{k: v for k, v in on_gpus.items() if k != "data"})
    synthetic = rules(tiny_berts["mlm"], data={"path": None, "synthetic": True})["encoder_synthetic_data"]
    assert "BertForMaskedLM" in synthetic.message
    config = json.loads((tiny_berts["mlm"] / "config.json").read_text())
    other = tmp_path / "token-classification"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**config, "architectures": ["BertForTokenClassification"]}))
    assert "supported: BertForMaskedLM, BertForSequenceClassification" in rules(other)["encoder_head"].message
