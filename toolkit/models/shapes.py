"""Model shapes: the handful of numbers that sizing and checking need, read without loading any weights.

The planner (`dsmt plan`) and the job-spec checks (`dsmt check`) need the same facts about a model: hidden size,
layers, heads, KV heads, FFN width, vocabulary, tied embeddings. They come from three places:
  * an HF checkpoint directory or a bare `config.json` of a Llama-like family (llama, mistral, qwen2, ...),
  * a GPT-2 shaped config (`n_embd`, `n_layer`, `n_head`),
  * a built-in table of well-known models (`llama3-70b`), so planning works with no checkpoint on disk.
The adapters (`toolkit/adapters`) do the full config translation for conversion; this module only reads shapes.
DeepSeek-V2 / V3 (multi-latent attention, shared experts, dense first layers) and Qwen2-MoE (a gated shared expert,
dense layers by `decoder_sparse_step` / `mlp_only_layers`) are read here too: toolkit/models/moe_shapes.py; the
token mixers of Qwen3-Next (Gated DeltaNet layers) and Llama 4 (chunked attention): toolkit/models/mixer_shapes.py.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from pathlib import Path

from toolkit.errors import DsmtError
from toolkit.models.mixer_shapes import (ATTENTION, CHUNKED, LINEAR, LLAMA4_LOCAL, QWEN3_NEXT_LOCAL, GatedDeltaNetShape,
                                         attention_extras, attention_softcap, llama4_text_fields, mixer_config_fields)
from toolkit.models.moe_shapes import MlaShape, MoeConfigError, moe_config_fields


class ModelShapeError(DsmtError):
    """A model reference that cannot be turned into a shape (missing file, unknown name, missing fields)."""


@dataclasses.dataclass(frozen=True)
class ModelShape:
    name: str
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    tied_embeddings: bool
    gated_mlp: bool  # SwiGLU-style MLP: three [h, ffn] matrices instead of two
    max_position_embeddings: int = 4096
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    # Mixture of experts (Mixtral, Qwen3-MoE): every layer's MLP is num_experts experts of width
    # moe_ffn_hidden_size, moe_topk of them per token, and a router [num_experts, hidden]. 0: a dense model.
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    # HF attn_logit_softcapping (Gemma 2): only megatron's local attention reproduces it, so the s x s scores are stored.
    attention_softcap: float | None = None
    # False: tp must divide num_kv_heads (OLMo-2's q / k norms span the heads; the family's `qk_norm_spans_heads`)
    kv_heads_replicable: bool = True
    # Multi-latent attention (DeepSeek-V2 / V3) in place of q / k / v projections; num_kv_heads = num_attention_heads
    # and head_dim = v_head_dim then (megatron's kv_channels is the attention's output width per head).
    mla: MlaShape | None = None
    # Shared experts (DeepSeek's n_shared_experts × moe_intermediate_size, Qwen2-MoE's
    # shared_expert_intermediate_size): one always-active dense MLP of this width in every MoE layer, split over TP
    # and replicated over EP like a dense MLP; Qwen2-MoE scales its output by sigmoid(x · shared_expert_gate), a
    # [1, h] weight. 0: none.
    shared_expert_ffn_hidden_size: int = 0
    shared_expert_gate: bool = False
    # MoE models: the 0-based layers whose MLP is dense at ffn_hidden_size (DeepSeek's first_k_dense_replace,
    # Qwen-MoE's mlp_only_layers / decoder_sparse_step); every other layer is an MoE layer.
    dense_layers: tuple[int, ...] = ()
    qkv_bias: bool = False  # biases on q, k and v (Qwen2 / Qwen2-MoE, `attention_bias`: Seed-OSS, GLM-4.5, GPT-OSS)
    output_bias: bool = False  # a bias on the attention output projection (GPT-OSS; Seed-OSS `attention_out_bias`)
    attention_sinks: bool = False  # one learnable logit per query head joining each softmax (GPT-OSS)
    # GPT-OSS: the router [E, h] has a bias [E], and each expert biases on its fc1 [2f] and fc2 [h].
    expert_bias: bool = False
    # Qwen3-Next: the layers whose token mixer is a Gated DeltaNet of these widths instead of softmax attention; its
    # attention layers' q_proj also makes an output gate per channel ([2·a·d, h]), and they norm each q / k head ([d]
    # weights); RoPE turns rotary_fraction of each head (partial_rotary_factor).
    linear_attention: GatedDeltaNetShape | None = None
    linear_attention_layers: tuple[int, ...] = ()
    gated_query: bool = False
    qk_norm: bool = False
    rotary_fraction: float = 1.0
    # Llama 4: the layers attending only within blocks of attention_chunk_size tokens (chunked local attention)
    attention_chunk_size: int | None = None
    chunked_attention_layers: tuple[int, ...] = ()
    # Why dsmt builds the model on megatron's local layers only (Qwen3-Next, Llama 4: their adapters refuse
    # Transformer Engine's), or None
    local_layers_only: str | None = None

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def qk_head_dim(self) -> int:
        """Width of one head's query and key: MLA's nope + rope dims, else the head dim."""
        return self.mla.qk_head_dim if self.mla else self.kv_channels

    @property
    def v_head_dim(self) -> int:
        return self.mla.v_head_dim if self.mla else self.kv_channels

    @property
    def rope_dim(self) -> int:
        """The dims RoPE rotates per head: MLA's decoupled qk_rope_head_dim, else the whole head."""
        return self.mla.qk_rope_head_dim if self.mla else int(self.kv_channels * self.rotary_fraction)

    def layer_mixer(self, layer: int) -> str:
        """How layer `layer` mixes tokens: mixer_shapes.LINEAR (Gated DeltaNet), CHUNKED or ATTENTION."""
        if layer in self.linear_attention_layers:
            return LINEAR
        return CHUNKED if layer in self.chunked_attention_layers else ATTENTION

    @property
    def mixed_layers(self) -> bool:
        """Whether layers differ in their token mixer (then the planner follows each layer's)."""
        return bool(self.linear_attention_layers or self.chunked_attention_layers)

    def layer_kinds(self, layers=None) -> dict[tuple[bool, str], int]:
        """(is an MoE layer, token mixer) -> how many of `layers` (default: all) are of that kind."""
        found: dict[tuple[bool, str], int] = {}
        for i in range(self.num_layers) if layers is None else layers:
            kind = (self.is_moe_layer(i), self.layer_mixer(i))
            found[kind] = found.get(kind, 0) + 1
        return found

    def attention_keys(self, *, mixer: str, seq_length: int) -> int:
        """The keys one query is scored against in a layer that computes only what its mask lets through: chunked
        attention's min(s, chunk), else s."""
        return min(seq_length, self.attention_chunk_size) if mixer == CHUNKED else seq_length

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer not in self.dense_layers

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    def _mlp_matrices(self) -> int:
        return 3 if self.gated_mlp else 2

    def expert_bias_params(self) -> int:
        """One expert's biases (GPT-OSS: fc1's gate and up, fc2's output); 0 where experts have none."""
        if not self.expert_bias:
            return 0
        return (2 if self.gated_mlp else 1) * self.moe_ffn_hidden_size + self.hidden_size

    def expert_params_per_layer(self) -> int:
        """The routed experts' weights (and biases) of one MoE layer (0 for a dense model); expert parallelism splits
        them over ep ranks."""
        per_expert = self._mlp_matrices() * self.hidden_size * self.moe_ffn_hidden_size + self.expert_bias_params()
        return self.num_experts * per_expert

    def router_params(self) -> int:
        """One MoE layer's router [E, h] and, where it has one, its bias [E]."""
        return self.num_experts * (self.hidden_size + (1 if self.expert_bias else 0))

    def shared_expert_params(self) -> int:
        """One MoE layer's shared experts and their gate (dense weights: TP-split, replicated over EP)."""
        h = self.hidden_size
        return self._mlp_matrices() * h * self.shared_expert_ffn_hidden_size + (h if self.shared_expert_gate else 0)

    def attention_matrix_params(self) -> int:
        """One layer's attention projection matrices (what its matmuls multiply by)."""
        h, heads = self.hidden_size, self.num_attention_heads
        if self.mla:
            return self.mla.matrix_params(hidden_size=h, num_heads=heads)
        d = self.kv_channels
        gate = heads * d * h if self.gated_query else 0
        return h * d * (heads + 2 * self.num_kv_heads) + heads * d * h + gate

    def attention_params(self) -> int:
        """One layer's attention parameters: the matrices, MLA's two latent norms, the q / k / v and output biases,
        the sinks."""
        extra = self.mla.latent_norm_params() if self.mla else 0
        if self.qkv_bias:
            extra += self.kv_channels * (self.num_attention_heads + 2 * self.num_kv_heads)
        extra += (self.hidden_size if self.output_bias else 0) + (self.num_attention_heads if self.attention_sinks else 0)
        return self.attention_matrix_params() + extra + (2 * self.kv_channels if self.qk_norm else 0)

    def mixer_params(self, mixer: str = ATTENTION) -> int:
        """One layer's token mixer: a Gated DeltaNet's parameters on LINEAR layers, else the attention's."""
        return self.linear_attention.params(hidden_size=self.hidden_size) if mixer == LINEAR else self.attention_params()

    def mixer_matrix_params(self, mixer: str = ATTENTION) -> int:
        if mixer == LINEAR:
            return self.linear_attention.matrix_params(hidden_size=self.hidden_size)
        return self.attention_matrix_params()

    def mlp_params(self, *, moe: bool) -> int:
        """One layer's MLP: dense at ffn_hidden_size, or the routed experts, router [E, h] and shared experts."""
        if moe:
            return self.expert_params_per_layer() + self.router_params() + self.shared_expert_params()
        return self._mlp_matrices() * self.hidden_size * self.ffn_hidden_size

    def active_mlp_params(self, *, moe: bool) -> int:
        """The MLP matrices one token passes through: a dense MLP whole; in an MoE layer the router, its top-k
        experts and the shared experts (with their gate)."""
        if not moe:
            return self.mlp_params(moe=False)
        routed = self.moe_topk * (self._mlp_matrices() * self.hidden_size * self.moe_ffn_hidden_size
                                  + self.expert_bias_params())
        return self.router_params() + routed + self.shared_expert_params()

    def params_per_layer(self, *, moe: bool | None = None, mixer: str = ATTENTION) -> int:
        """One layer's parameters (an MoE layer's when `moe`, default: whether the model is MoE)."""
        moe = self.is_moe if moe is None else moe
        return self.mixer_params(mixer) + self.mlp_params(moe=moe) + 2 * self.hidden_size  # two norms

    def num_params(self) -> int:
        """Parameter count of the unpadded model (norm weights, attention, router and expert biases included; the
        biases of dense MLPs and LayerNorms (GPT-2, StarCoder2), a few thousand per layer, not)."""
        layers = sum(count * self.params_per_layer(moe=moe, mixer=mixer)
                     for (moe, mixer), count in self.layer_kinds().items())
        return layers + self.embedding_params() + self.hidden_size

    def active_params(self) -> int:
        """Parameters one token uses (MoE: the top-k experts of each MoE layer; embeddings and norms included)."""
        layers = sum(count * (self.mixer_params(mixer) + 2 * self.hidden_size + self.active_mlp_params(moe=moe))
                     for (moe, mixer), count in self.layer_kinds().items())
        return layers + self.embedding_params() + self.hidden_size

    def embedding_params(self) -> int:
        """Input embedding plus output layer (counted once when tied)."""
        return self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)


def _llama_like(name, h, layers, heads, kv, ffn, vocab, *, tied=False, max_pos=8192):
    return ModelShape(name, h, layers, heads, kv, ffn, vocab, tied, True, max_pos)


def _deepseek(name, h, layers, heads, dense_ffn, vocab, *, experts, topk, moe_ffn, shared, first_dense, q_lora):
    """A DeepSeek-V2 / V3 shape: MLA with kv_lora_rank 512, nope / rope / v head dims 128 / 64 / 128, untied."""
    return ModelShape(name, h, layers, heads, heads, dense_ffn, vocab, False, True, 163840, head_dim=128,
                      num_experts=experts, moe_topk=topk, moe_ffn_hidden_size=moe_ffn,
                      mla=MlaShape(q_lora, 512, 128, 64, 128), shared_expert_ffn_hidden_size=shared * moe_ffn,
                      dense_layers=tuple(range(first_dense)))


def _qwen2_moe(name, h, layers, heads, kv, dense_ffn, *, experts, topk, moe_ffn, shared, max_pos):
    """A Qwen2-MoE shape: one gated shared expert, q / k / v biases, vocabulary 151936, untied, every layer MoE."""
    return ModelShape(name, h, layers, heads, kv, dense_ffn, 151936, False, True, max_pos, num_experts=experts,
                      moe_topk=topk, moe_ffn_hidden_size=moe_ffn, shared_expert_ffn_hidden_size=shared,
                      shared_expert_gate=True, qkv_bias=True)


def _gpt_oss(name, *, layers, experts):
    return ModelShape(name, 2880, layers, 64, 8, 2880, 201088, False, True, 131072, head_dim=64, num_experts=experts,
                      moe_topk=4, moe_ffn_hidden_size=2880, qkv_bias=True, output_bias=True, attention_sinks=True,
                      expert_bias=True)


def _llama4(name, *, experts, moe_every, max_pos):
    """A Llama 4 text shape (transformers' Llama4TextConfig defaults, Scout's: h 5120, 48 layers, 40 query / 8 KV heads
    of 128, experts and shared expert of 8192, dense layers of 16384, vocabulary 202048, top-1, untied; chunks of
    8192 tokens on the RoPE layers, all but every 4th)."""
    return ModelShape(name, 5120, 48, 40, 8, 16384, 202048, False, True, max_pos, head_dim=128, num_experts=experts,
                      moe_topk=1, moe_ffn_hidden_size=8192, shared_expert_ffn_hidden_size=8192,
                      dense_layers=tuple(i for i in range(48) if (i + 1) % moe_every), attention_chunk_size=8192,
                      chunked_attention_layers=tuple(i for i in range(48) if (i + 1) % 4), local_layers_only=LLAMA4_LOCAL)


# Published shapes (config.json of each release).
BUILTIN_SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in [
        _llama_like("llama2-7b", 4096, 32, 32, 32, 11008, 32000, max_pos=4096),
        _llama_like("llama2-13b", 5120, 40, 40, 40, 13824, 32000, max_pos=4096),
        _llama_like("llama2-70b", 8192, 80, 64, 8, 28672, 32000, max_pos=4096),
        _llama_like("llama3-8b", 4096, 32, 32, 8, 14336, 128256),
        _llama_like("llama3-70b", 8192, 80, 64, 8, 28672, 128256),
        _llama_like("llama3-405b", 16384, 126, 128, 8, 53248, 128256),
        _llama_like("llama3.2-1b", 2048, 16, 32, 8, 8192, 128256, tied=True),
        _llama_like("mistral-7b", 4096, 32, 32, 8, 14336, 32000, max_pos=32768),
        _llama_like("qwen2-7b", 3584, 28, 28, 4, 18944, 152064, max_pos=32768),
        _llama_like("qwen2-72b", 8192, 80, 64, 8, 29568, 152064, max_pos=32768),
        # toolkit/models/tiny.py's TINY_LLAMA (its character tokenizer fits the 250 ids): CPU pretraining tests.
        _llama_like("tiny-llama", 64, 4, 8, 2, 96, 250, max_pos=128),
        # GPT-3 175B (Brown et al. 2020) and the 1T configuration of Narayanan et al. 2021, Table 1.
        ModelShape("gpt3-175b", 12288, 96, 96, 96, 4 * 12288, 51200, True, False, 2048),
        ModelShape("gpt-1t", 25600, 128, 160, 160, 4 * 25600, 51200, True, False, 2048),
        # Mixtral-8x7B-v0.1 and Qwen3-30B-A3B (config.json of the releases).
        ModelShape("mixtral-8x7b", 4096, 32, 32, 8, 14336, 32000, False, True, 32768,
                   num_experts=8, moe_topk=2, moe_ffn_hidden_size=14336),
        ModelShape("qwen3-30b-a3b", 2048, 48, 32, 4, 6144, 151936, False, True, 40960, head_dim=128,
                   num_experts=128, moe_topk=8, moe_ffn_hidden_size=768),
        # DeepSeek-V2-Lite, V2 and V3 (V3's multi-token-prediction layer is not part of the model transformers
        # loads, nor of training) and Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B (config.json of the releases).
        _deepseek("deepseek-v2-lite", 2048, 27, 16, 10944, 102400, experts=64, topk=6, moe_ffn=1408, shared=2,
                  first_dense=1, q_lora=None),
        _deepseek("deepseek-v2", 5120, 60, 128, 12288, 102400, experts=160, topk=6, moe_ffn=1536, shared=2,
                  first_dense=1, q_lora=1536),
        _deepseek("deepseek-v3", 7168, 61, 128, 18432, 129280, experts=256, topk=8, moe_ffn=2048, shared=1,
                  first_dense=3, q_lora=1536),
        # gpt-oss-20b / 120b (config.json of the releases; the model card's 20.9 B / 116.8 B totals): 64 query and
        # 8 KV heads of 64 (wider than hidden 2880), q / k / v / o biases and sinks, top-4 experts with biases.
        _gpt_oss("gpt-oss-20b", layers=24, experts=32),
        _gpt_oss("gpt-oss-120b", layers=36, experts=128),
        # GLM-4.5-Air (transformers' Glm4MoeConfig defaults are its config.json): 96 query heads of 128 (wider than
        # hidden 4096), q / k / v biases, one dense first layer, 128 experts top-8 plus one shared; its MTP layer
        # is not part of the model transformers loads.
        ModelShape("glm-4.5-air", 4096, 46, 96, 8, 10944, 151552, False, True, 131072, head_dim=128, num_experts=128,
                   moe_topk=8, moe_ffn_hidden_size=1408, shared_expert_ffn_hidden_size=1408, dense_layers=(0,),
                   qkv_bias=True, rotary_fraction=0.5),
        # Qwen3-Next-80B-A3B (transformers' Qwen3NextConfig defaults are its config.json but for intermediate_size,
        # 5120 there, which no layer uses: every layer is MoE; and max_position_embeddings 262144): Gated DeltaNet on
        # 3 of every 4 layers (16 key / 32 value heads of 128, conv kernel 4), gated attention on the 4th (16 query /
        # 2 KV heads of 256, RoPE on a quarter), 512 experts of 512 top-10 and a gated shared expert of 512.
        ModelShape("qwen3-next-80b-a3b", 2048, 48, 16, 2, 5120, 151936, False, True, 262144, head_dim=256,
                   num_experts=512, moe_topk=10, moe_ffn_hidden_size=512, shared_expert_ffn_hidden_size=512,
                   shared_expert_gate=True, linear_attention=GatedDeltaNetShape(16, 32, 128, 128, 4),
                   linear_attention_layers=tuple(i for i in range(48) if (i + 1) % 4), gated_query=True,
                   qk_norm=True, rotary_fraction=0.25, kv_heads_replicable=False, local_layers_only=QWEN3_NEXT_LOCAL),
        # Llama-4-Scout-17B-16E and Maverick-17B-128E's text_config (Scout: every layer MoE over 16 experts, context
        # 10M; Maverick: 128 experts on every 2nd layer, interleave_moe_layer_step 2, context 1M).
        _llama4("llama4-scout-17b-16e", experts=16, moe_every=1, max_pos=10485760),
        _llama4("llama4-maverick-17b-128e", experts=128, moe_every=2, max_pos=1048576),
        _qwen2_moe("qwen1.5-moe-a2.7b", 2048, 24, 16, 16, 5632, experts=60, topk=4, moe_ffn=1408, shared=5632,
                   max_pos=8192),
        _qwen2_moe("qwen2-57b-a14b", 3584, 28, 28, 4, 18944, experts=64, topk=8, moe_ffn=2560, shared=20480,
                   max_pos=131072),
    ]
}


# Megatron's default padding unit (make_vocab_size_divisible_by). dsmt pads to a multiple of it alone, not of it
# times tp as Megatron-LM does: the padded vocabulary, and so a converted checkpoint, is then the same for every
# power-of-two tp up to 128, which is what lets one checkpoint load at any layout.
VOCAB_PAD_MULTIPLE = 128


def padded_vocab_size(vocab_size: int, *, multiple: int = VOCAB_PAD_MULTIPLE) -> int:
    """The vocabulary rounded up to `multiple` rows (the extra rows are zeros, dropped on export)."""
    return -(-vocab_size // multiple) * multiple


def read_model_ref(ref: str | Path):
    """What `ref` names: a built-in name's shape, else the config.json (a dict) of an HF checkpoint directory or
    of a path to a config.json. toolkit/adapters/model_shape.py `load_model_shape` turns the dict into a shape with
    its family's layer facts."""
    text = str(ref)
    if text in BUILTIN_SHAPES and Path(text).exists():
        raise ModelShapeError(f"model {text!r} names both the built-in shape {text} and the folder "
                              f"{Path(text).resolve()}; write ./{text} for the folder")
    if text in BUILTIN_SHAPES:
        return BUILTIN_SHAPES[text]
    path = Path(ref)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelShapeError(_not_a_model_folder(path, text=text))
        path = path / "config.json"
    if not path.is_file():
        near = difflib.get_close_matches(text, BUILTIN_SHAPES, n=3)
        hint = f" Did you mean: {', '.join(near)}?" if near else ""
        raise ModelShapeError(
            f"model {text!r} is neither a built-in shape nor an existing checkpoint directory or config.json.{hint} "
            f"Built-in shapes: {', '.join(sorted(BUILTIN_SHAPES))}."
        )
    from toolkit.models.remote_code import refuse_remote_code

    # a folder that would run its own code is refused by name, whatever reads it
    refuse_remote_code(path.parent, only=("config.json",))
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ModelShapeError(f"cannot read {path} as JSON ({err}); pass a valid HF config.json") from err
    return config


def _not_a_model_folder(path: Path, *, text: str) -> str:
    """What a folder without config.json holds, and the sub-folders that are models (the user may have named
    their parent)."""
    entries = sorted(path.iterdir())
    held = ", ".join(e.name + ("/" if e.is_dir() else "") for e in entries[:5]) or "nothing"
    more = f" and {len(entries) - 5} more" if len(entries) > 5 else ""
    models = [e.name for e in entries if (e / "config.json").is_file()]
    hint = f"; these sub-folders of it have one: {', '.join(models[:3])}" if models else ""
    return f"model {text!r} is a folder but not an HF checkpoint: it has no config.json (it holds {held}{more}){hint}"


def shape_from_fields(config: dict, *, name: str, gated_mlp: bool, kv_heads_replicable: bool,
                      qkv_bias: bool = False, local_layers_only: str | None = None) -> ModelShape:
    """Shape from an HF config dict, Llama-like or GPT-2 shaped. What the config does not say of its family's layers
    comes from the caller (toolkit/adapters/model_shape.py reads it from the adapter family): whether the MLP is
    gated (Gemma's GeGLU is, with a GELU), whether TP may replicate KV heads (not where q / k norms span the
    heads, OLMo-2) and whether the family builds on megatron's local layers only (Qwen3-Next, Llama 4)."""
    if "n_embd" in config:  # GPT-2 naming
        h = _field(config, "n_embd", name)
        heads = _field(config, "n_head", name)
        return ModelShape(
            name=name, hidden_size=h, num_layers=_field(config, "n_layer", name), num_attention_heads=heads,
            num_kv_heads=heads, ffn_hidden_size=config.get("n_inner") or 4 * h,
            vocab_size=_field(config, "vocab_size", name), tied_embeddings=config.get("tie_word_embeddings", True),
            gated_mlp=False, max_position_embeddings=config.get("n_positions", 1024),
        )
    config = llama4_text_fields(config)  # a Llama 4 multimodal config not yet read through its wrapper
    heads = _field(config, "num_attention_heads", name)
    layers = _field(config, "num_hidden_layers", name)
    fields = dict(
        name=name, hidden_size=_field(config, "hidden_size", name), num_layers=layers,
        num_attention_heads=heads, num_kv_heads=config.get("num_key_value_heads") or heads,
        ffn_hidden_size=_field(config, "intermediate_size", name), vocab_size=_field(config, "vocab_size", name),
        tied_embeddings=bool(config.get("tie_word_embeddings", False)), gated_mlp=gated_mlp,
        max_position_embeddings=config.get("max_position_embeddings", 4096), head_dim=config.get("head_dim"),
        attention_softcap=attention_softcap(config),
        kv_heads_replicable=kv_heads_replicable, local_layers_only=local_layers_only,
        **attention_extras(config, qkv_bias=qkv_bias),
    )
    try:  # MoE (Mixtral, Qwen-MoE, DeepSeek) and multi-latent attention fields; they may replace the KV heads
        fields.update(moe_config_fields(config, num_layers=layers))
        fields.update(mixer_config_fields(config, num_layers=layers))  # Qwen3-Next, Llama 4: after the MoE fields
    except MoeConfigError as err:
        raise ModelShapeError(f"{name}: {err}") from err
    return ModelShape(**fields)


def _field(config: dict, key: str, name: str) -> int:
    if key not in config:
        raise ModelShapeError(f"config of {name!r} has no {key!r}; it is not a Llama-like or GPT-2 shaped config")
    return config[key]
