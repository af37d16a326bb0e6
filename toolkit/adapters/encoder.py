"""BERT-style encoders on megatron-core: a post-LayerNorm layer spec and the encoder model with its task head.

HF BERT normalises AFTER each residual add (post-LN); megatron-core's `TransformerLayer` normalises before
attention and MLP (pre-LN), and its `apply_residual_connection_post_layernorm` field is not read by mcore 0.16.
The layer spec below keeps megatron's layer and changes only its submodules:

    megatron TransformerLayer slot     pre-LN (GPT)            post-LN (here, = HF BertLayer)
    input_layernorm                    norm                    IdentityOp
    self_attn_bda                      bias-dropout-add        bias-dropout-add, then attention.output.LayerNorm
    pre_mlp_layernorm                  norm                    IdentityOp
    mlp_bda                            bias-dropout-add        bias-dropout-add, then output.LayerNorm

so `h1 = LN1(x + attn(x))`, `h2 = LN2(h1 + mlp(h1))`: the residual megatron carries into the MLP is the normalised
`h1`, as in HF. The block has no final norm (HF has none after the last layer).

The embedding LayerNorm (HF `embeddings.LayerNorm` over word + position + token-type embeddings, before the
embedding dropout) has no slot in megatron's `LanguageModelEmbedding`: `EncoderEmbedding` registers it and runs it
as a forward pre-hook of megatron's embedding dropout module, i.e. exactly between the sum (already cut to this
rank's sequence slice under sequence parallelism) and the dropout, without copying megatron's forward.

megatron's `BertModel` always builds its MLM head and a 2-way binary head; HF's `BertForSequenceClassification`
has a pooler and a `num_labels` classifier and no MLM head, `BertForMaskedLM` the MLM head and no pooler. The two
models below compose megatron's pieces (embedding, `TransformerBlock`, `BertLMHead`, `Pooler`) in a
`LanguageModule` so that every megatron parameter has an HF tensor and the other way round. Two more HF rules
they follow: the padding mask hides padded KEYS only (megatron's BertModel also blanks padded queries' rows,
which changes the outputs at padded positions), and the pad id's word-embedding row gets no gradient from its
lookups (HF's `padding_idx`). This module imports megatron: `toolkit.adapters.build` imports it on first use.
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
from megatron.core.models.bert.bert_lm_head import BertLMHead
from megatron.core.models.bert.pooler import Pooler
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, get_linear_layer

from toolkit.adapters.family import AdapterError
from toolkit.adapters.norms import TorchNorm
from toolkit.adapters.vocab_mask import mask_padded_vocab


def post_norm_layer_spec(config):
    """megatron's local BERT layer spec with the two norms moved after the residual adds (see the module doc)."""
    add_then_norm = ModuleSpec(module=PostNormBiasDropoutAdd, params={"config": config})
    submodules = dataclasses.replace(
        bert_layer_local_spec.submodules, input_layernorm=IdentityOp, pre_mlp_layernorm=IdentityOp,
        self_attn_bda=add_then_norm, mlp_bda=add_then_norm,
        sharded_state_dict_keys_map={},  # megatron's keys move the (now absent) pre-norms under the linears
    )
    return dataclasses.replace(bert_layer_local_spec, submodules=submodules)


class PostNormBiasDropoutAdd(torch.nn.Module):
    """megatron's bias-dropout-add followed by this module's LayerNorm, in a `*_bda` slot of `TransformerLayer`.

    The layer calls `bda(training, fused)` and then the returned function with (output_with_bias, residual,
    dropout_prob); a module (not a function) so that the norm's parameters belong to the layer. The norm weights
    are marked `sequence_parallel` (`TorchNorm`): under sequence parallelism each TP rank normalises its slice."""

    def __init__(self, *, config):
        super().__init__()
        self.layer_norm = TorchNorm(config, config.hidden_size, eps=config.layernorm_epsilon)

    def forward(self, training: bool, fused: bool):
        bias_dropout_add = get_bias_dropout_add(training, fused)

        def bias_dropout_add_norm(output_with_bias, residual, dropout_prob):
            return self.layer_norm(bias_dropout_add(output_with_bias, residual, dropout_prob))

        return bias_dropout_add_norm


class EncoderEmbedding(LanguageModelEmbedding):
    """megatron's word + learned position + token-type embedding, then HF's embedding LayerNorm, then dropout.

    The norm runs as a forward pre-hook of `embedding_dropout`, the module megatron applies last: HF's order
    (sum, LayerNorm, dropout) also when dropout is on, and megatron's forward is reused as it is.
    HF's word embedding is `nn.Embedding(padding_idx=pad_token_id)`: the pad row gets no gradient from the tokens
    that look it up (with tied embeddings it still gets the MLM decoder's). megatron's has no padding_idx, so a hook
    zeroes the gradient of the lookups of `padding_idx` (it matters where the MLM collator's random replacement
    puts a pad id at a real position)."""

    def __init__(self, *, config, padding_idx: int | None = None, **kwargs):
        super().__init__(config=config, **kwargs)
        self.layer_norm = TorchNorm(config, config.hidden_size, eps=config.layernorm_epsilon)
        self.embedding_dropout.register_forward_pre_hook(self._normalise_before_dropout)
        self.padding_idx = padding_idx
        if padding_idx is not None:
            self.word_embeddings.register_forward_hook(self._no_gradient_through_padding_lookups)

    def _normalise_before_dropout(self, module, args):
        return (self.layer_norm(args[0]),)

    def _no_gradient_through_padding_lookups(self, module, args, output):
        if output.requires_grad:  # output [b, s, h] of input_ids [b, s] (BERT's embedding reduces, never scatters)
            is_padding = (args[0] == self.padding_idx).unsqueeze(-1)
            output.register_hook(lambda grad: grad.masked_fill(is_padding, 0.0))


class EncoderModel(LanguageModule):
    """Embedding (first stage), post-LN `TransformerBlock` named `encoder` as in megatron's BertModel, and
    the task head (last stage). Inputs are HF's: input_ids [b, s], attention_mask [b, s] (1 = token,
    0 = padding), token_type_ids [b, s] or None (all type 0, as HF)."""

    def __init__(self, *, config, vocab_size: int, max_sequence_length: int, num_tokentypes: int,
                 pre_process: bool, post_process: bool, vp_stage: int | None, tied_embeddings: bool = False,
                 padding_idx: int | None = None):
        super().__init__(config=config)
        self.pre_process, self.post_process, self.vp_stage = pre_process, post_process, vp_stage
        self.model_type = ModelType.encoder_or_decoder
        self.share_embeddings_and_output_weights = tied_embeddings
        self.vocab_size = vocab_size
        if pre_process:
            self.embedding = EncoderEmbedding(config=config, vocab_size=vocab_size,
                                              max_sequence_length=max_sequence_length,
                                              position_embedding_type="learned_absolute",
                                              num_tokentypes=num_tokentypes, padding_idx=padding_idx)
        self.encoder = TransformerBlock(config=config, spec=post_norm_layer_spec(config), post_layer_norm=False,
                                        pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)

    def set_input_tensor(self, input_tensor) -> None:
        """The pipeline schedule hands a non-first stage its input here (a list of one tensor)."""
        self.encoder.set_input_tensor(input_tensor[0] if isinstance(input_tensor, list) else input_tensor)

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        # [b, 1, 1, s], True = masked: every query (padding ones too) sees the real keys only, as HF's mask;
        # megatron's BertModel masks padded queries' rows as well, which changes padded positions' outputs.
        key_mask = (attention_mask < 0.5)[:, None, None, :]
        hidden_states = None
        if self.pre_process:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
            if token_type_ids is None and self.embedding.tokentype_embeddings is not None:
                token_type_ids = torch.zeros_like(input_ids)
            hidden_states = self.embedding(input_ids=input_ids, position_ids=position_ids,
                                           tokentype_ids=token_type_ids)
        hidden_states = self.encoder(hidden_states=hidden_states, attention_mask=key_mask)
        return self.head(hidden_states) if self.post_process else hidden_states


class MaskedLMEncoder(EncoderModel):
    """HF `*ForMaskedLM`: megatron's `BertLMHead` (dense, activation, LayerNorm) and an output layer with a
    bias, tied to the word embeddings. Returns logits [b, s, vocab (/ tp when parallel_output)]."""

    def __init__(self, *, parallel_output: bool = True, tied_embeddings: bool = True, **kwargs):
        super().__init__(tied_embeddings=tied_embeddings, **kwargs)
        config = self.config
        if self.post_process:
            self.lm_head = BertLMHead(config.hidden_size, dataclasses.replace(config, sequence_parallel=False))
            # BertLMHead takes megatron's WrappedTorchNorm, which refuses sequence parallelism; its dense
            # layer sees this rank's sequence slice, so under SP its gradients are partial per rank too.
            self.lm_head.config = config
            self.lm_head.layer_norm = TorchNorm(config, config.hidden_size, eps=config.layernorm_epsilon)
            self.lm_head.gelu = config.activation_func  # HF applies config.hidden_act here
            for param in self.lm_head.dense.parameters():
                param.sequence_parallel = config.sequence_parallel
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                config.hidden_size, self.vocab_size, config=config, init_method=config.init_method, bias=True,
                skip_bias_add=False, gather_output=not parallel_output,
                skip_weight_param_allocation=self.pre_process and tied_embeddings)
        if self.pre_process or self.post_process:
            self.setup_embeddings_and_output_layer()

    def head(self, hidden_states):
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(self.lm_head(hidden_states), weight=weight)
        return logits.transpose(0, 1).contiguous()  # [s, b, v] -> [b, s, v]


class SequenceClassificationEncoder(EncoderModel):
    """HF `*ForSequenceClassification`: megatron's `Pooler` (dense + tanh on token 0), dropout, and a
    `num_labels` linear classifier (replicated over TP). Returns [b, num_labels] (regression: num_labels 1)."""

    def __init__(self, *, num_labels: int, classifier_dropout: float = 0.0, **kwargs):
        super().__init__(tied_embeddings=False, **kwargs)
        config = self.config
        if self.post_process:
            self.pooler = Pooler(config.hidden_size, config.init_method, config, config.sequence_parallel)
            self.classifier_dropout = torch.nn.Dropout(classifier_dropout)
            self.classifier = get_linear_layer(config.hidden_size, num_labels, config.init_method,
                                               config.perform_initialization)

    def head(self, hidden_states):
        return self.classifier(self.classifier_dropout(self.pooler(hidden_states, 0)))

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        # LanguageModule's version ties / pads an `output_layer`, which this model does not have.
        return MegatronModule.sharded_state_dict(self, prefix, sharded_offsets,
                                                 ensure_metadata_has_dp_cp_group(metadata))


def check_encoder_attention(*, attention: str | None, cp_size: int) -> None:
    """The encoder's layers are megatron's local (torch) ones: Transformer Engine's fuse a pre-norm into their
    linear layers, which a post-LN layer cannot use, and context parallelism needs TE's attention."""
    if attention == "fused" or cp_size > 1:
        raise AdapterError(f"training.attention={attention}, parallel.cp={cp_size}: dsmt's BERT-style encoder is "
                           "built from megatron's local layers (post-LayerNorm; Transformer Engine's layers fuse a "
                           "pre-norm), which have neither fused attention nor context parallelism; set "
                           "training.attention: local and parallel.cp: 1")


def encoder_chunks(*, config, settings, vpp_size: int, parallel_output: bool = True):
    """Yield this rank's encoder model per virtual stage, as `build.gpt_chunks` does for decoders. `settings`: the
    adapters' ModelSettings of an encoder family (its `encoder` says which head)."""
    encoder = settings.encoder
    if encoder.task == "masked_lm":
        model_class, extra = MaskedLMEncoder, {"parallel_output": parallel_output,
                                               "tied_embeddings": settings.tied_embeddings}
    else:
        model_class, extra = SequenceClassificationEncoder, {"num_labels": encoder.num_labels,
                                                             "classifier_dropout": encoder.classifier_dropout}
    for vp_stage in range(vpp_size):
        vp = vp_stage if vpp_size > 1 else None
        model = model_class(
            config=config, vocab_size=settings.padded_vocab_size, max_sequence_length=settings.max_position_embeddings,
            num_tokentypes=encoder.num_tokentypes, padding_idx=encoder.padding_idx, vp_stage=vp,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp), **extra,
        )
        if encoder.task == "masked_lm" and model.post_process:
            mask_padded_vocab(model.output_layer, settings=settings)  # the MLM head's logits, as GPTModel's
        yield model
