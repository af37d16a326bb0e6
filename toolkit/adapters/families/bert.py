"""BERT (HF `BertForMaskedLM`, `BertForSequenceClassification`): a post-LayerNorm encoder with learned absolute
positions, token-type embeddings, an embedding LayerNorm, exact (erf) GELU and biases everywhere. megatron-core
builds it from toolkit/adapters/encoder.py (post-LN layer spec, encoder model and heads); the head, and with it the
training task, is the class in config.architectures[0]:

  BertForMaskedLM                 MLM head (dense, GELU, LayerNorm, decoder tied to the word embeddings + bias)
  BertForSequenceClassification   pooler (dense + tanh on token 0) and a num_labels classifier (1 = regression)

HF's dropout (hidden_dropout_prob, attention_probs_dropout_prob, classifier_dropout) is kept for training.
"""

from toolkit.adapters.family import Architecture, HeadTable, ModelFamily, WeightMapping, register
from toolkit.adapters.transforms import Kind

M = WeightMapping  # keeps the table one row per line
R = Kind.REPLICATED
L = "bert.encoder.layer.*."

BERT_WEIGHTS = (
    M("embedding.word_embeddings.weight", Kind.VOCAB, ("bert.embeddings.word_embeddings.weight",)),
    M("embedding.position_embeddings.weight", R, ("bert.embeddings.position_embeddings.weight",)),
    M("embedding.tokentype_embeddings.weight", R, ("bert.embeddings.token_type_embeddings.weight",)),
    M("embedding.layer_norm.weight", R, ("bert.embeddings.LayerNorm.weight",)),
    M("embedding.layer_norm.bias", R, ("bert.embeddings.LayerNorm.bias",)),
    # q, k, v of each head are one query group of their own (no GQA): QKV interleaves them per head
    M("encoder.layers.*.self_attention.linear_qkv.weight", Kind.QKV,
      (L + "attention.self.query.weight", L + "attention.self.key.weight", L + "attention.self.value.weight")),
    M("encoder.layers.*.self_attention.linear_qkv.bias", Kind.QKV,
      (L + "attention.self.query.bias", L + "attention.self.key.bias", L + "attention.self.value.bias")),
    M("encoder.layers.*.self_attention.linear_proj.weight", Kind.ROW, (L + "attention.output.dense.weight",)),
    M("encoder.layers.*.self_attention.linear_proj.bias", R, (L + "attention.output.dense.bias",)),
    M("encoder.layers.*.self_attn_bda.layer_norm.weight", R, (L + "attention.output.LayerNorm.weight",)),
    M("encoder.layers.*.self_attn_bda.layer_norm.bias", R, (L + "attention.output.LayerNorm.bias",)),
    M("encoder.layers.*.mlp.linear_fc1.weight", Kind.COLUMN, (L + "intermediate.dense.weight",)),
    M("encoder.layers.*.mlp.linear_fc1.bias", Kind.COLUMN, (L + "intermediate.dense.bias",)),
    M("encoder.layers.*.mlp.linear_fc2.weight", Kind.ROW, (L + "output.dense.weight",)),
    M("encoder.layers.*.mlp.linear_fc2.bias", R, (L + "output.dense.bias",)),
    M("encoder.layers.*.mlp_bda.layer_norm.weight", R, (L + "output.LayerNorm.weight",)),
    M("encoder.layers.*.mlp_bda.layer_norm.bias", R, (L + "output.LayerNorm.bias",)),
)
# tie_word_embeddings=False: the decoder has its own weight (and its own bias; refused by check_bert_config).
UNTIED_DECODER = M("output_layer.weight", Kind.VOCAB, ("cls.predictions.decoder.weight",))
# Older checkpoints store the position ids; pretraining checkpoints carry heads another class does not use.
BUFFERS = ("bert.embeddings.position_ids",)
NSP_HEAD = ("cls.seq_relationship.weight", "cls.seq_relationship.bias")

MASKED_LM = HeadTable(
    hf_architecture="BertForMaskedLM", task="masked_lm",
    weights=(
        M("lm_head.dense.weight", R, ("cls.predictions.transform.dense.weight",)),
        M("lm_head.dense.bias", R, ("cls.predictions.transform.dense.bias",)),
        M("lm_head.layer_norm.weight", R, ("cls.predictions.transform.LayerNorm.weight",)),
        M("lm_head.layer_norm.bias", R, ("cls.predictions.transform.LayerNorm.bias",)),
        M("output_layer.bias", Kind.VOCAB, ("cls.predictions.bias",)),
    ),
    # tied (the only kind accepted): decoder.weight is the word embeddings and decoder.bias cls.predictions.bias,
    # one tensor each in HF, which older checkpoints store twice; a pretraining checkpoint's pooler is unused here
    ignored_hf=("cls.predictions.decoder.weight", "cls.predictions.decoder.bias", "bert.pooler.dense.weight",
                "bert.pooler.dense.bias") + NSP_HEAD,
)
SEQUENCE_CLASSIFICATION = HeadTable(
    hf_architecture="BertForSequenceClassification", task="sequence_classification",
    weights=(
        M("pooler.dense.weight", R, ("bert.pooler.dense.weight",)),
        M("pooler.dense.bias", R, ("bert.pooler.dense.bias",)),
        M("classifier.weight", R, ("classifier.weight",)),
        M("classifier.bias", R, ("classifier.bias",)),
    ),
)


def read_bert_config(hf_config) -> dict:
    return dict(layernorm_epsilon=hf_config.layer_norm_eps, num_query_groups=hf_config.num_attention_heads,
                hidden_dropout=float(hf_config.hidden_dropout_prob),
                attention_dropout=float(hf_config.attention_probs_dropout_prob))


def check_bert_config(hf_config) -> list[str]:
    problems = []
    if getattr(hf_config, "is_decoder", False) or getattr(hf_config, "add_cross_attention", False):
        problems.append("is_decoder / add_cross_attention: the bert adapter builds the bidirectional encoder only")
    kind = getattr(hf_config, "position_embedding_type", "absolute")
    if kind != "absolute":
        problems.append(f"position_embedding_type={kind!r}: megatron-core has learned absolute positions only")
    if getattr(hf_config, "type_vocab_size", 0) < 1:
        problems.append(f"type_vocab_size={hf_config.type_vocab_size}: BERT's embedding needs >= 1 token type")
    architectures = getattr(hf_config, "architectures", None) or []
    if architectures[:1] == ["BertForMaskedLM"] and not getattr(hf_config, "tie_word_embeddings", True):
        problems.append("tie_word_embeddings=False: HF's untied BERT decoder adds its own bias (decoder.bias) "
                        "instead of cls.predictions.bias; only the tied MLM head (every released BERT) is supported")
    if getattr(hf_config, "problem_type", None) == "multi_label_classification":
        problems.append("problem_type='multi_label_classification' (BCE loss) is not a dsmt training task; "
                        "supported: regression (num_labels=1), single_label_classification")
    return problems


BERT = register(ModelFamily(
    model_type="bert", hf_architecture="BertForMaskedLM", weights=BERT_WEIGHTS, untied_output=UNTIED_DECODER,
    ignored_hf=BUFFERS,
    architecture=Architecture(activation="gelu", gated_mlp=False, normalization="LayerNorm", linear_bias=True,
                              position_embedding="learned_absolute"),
    read_config=read_bert_config, check_config=check_bert_config, heads=(MASKED_LM, SEQUENCE_CLASSIFICATION),
))
