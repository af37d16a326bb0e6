"""LoRA on megatron-core chunks, with PEFT's own tensors: exact parity with `peft` and a trivial export.

One adapter per targeted HF module (q_proj, v_proj, down_proj, ...; GPT-2: c_attn, c_proj, c_fc), found from the
family's weight-table rows of the four megatron linears (`LINEARS`). Each adapter holds PEFT's tensors FULL and
REPLICATED on every TP rank, in HF orientation: lora_A [r, in], lora_B [out, r] (PEFT stores Conv1D LoRA the same
way). A forward hook on the megatron linear calls the adapter (its own module, the `lora` child of the linear),
which returns this rank's share of scaling * B A x, the megatron-layout matrices being built in the forward with the
SAME transforms as the weights (`column_lora_matrices`):

  column-parallel base (linear_qkv, linear_fc1), x the layer's normalised input:
      A_all = cat(A of the targeted modules)                              [k*r, in]
      B_local = shard(kind, to_megatron(kind, [[B_q,0,0],[0,B_k,0],[0,0,B_v]]))  (zero blocks are constants;
                an untargeted module of the fused layer has no block)
      out_local += scaling * copy_to_tp(x) A_all^T B_local^T   (gather_from_sequence_parallel under SP)
      -> the gradients of A and B on each rank are partial: marked `tensor_parallel_partial_grad`, the engine sums
         them over TP (toolkit/train/engine/hybrid.py `sequence_parallel_params`).
  row-parallel base (linear_proj, linear_fc2), x_local this rank's input columns:
      h = reduce_from_tp(x_local shard(ROW, A)^T)              (reduce_scatter_to_sequence_parallel under SP)
      out += scaling * h B^T
      -> A's gradient partial (marked); B's full and identical on every TP rank (partial under SP: marked then).
The LoRA parameters carry no `tensor_model_parallel` attribute: DeepSpeed counts them once in the grad norm.
scaling = alpha / rank (PEFT's default, not rslora); dropout on the LoRA input as PEFT does.
ZeRO-3 partitions the adapters and the frozen base weights alike. DeepSpeed gathers a module's OWN parameters in
its pre-forward hook (and again before that module's backward) and releases them after: the base linear's forward
reads only its weight, the adapter's forward only its A / B (direct parameters of `LoraAdapter`, not of a child
module), so both are whole exactly while in use, with DeepSpeed's prefetch. The merge and the adapter export read
them at export only, inside `params_on_cpu` (toolkit/adapters/zero3.py); `export.require_whole` checks it.
Applied to a rank's chunks by toolkit/train/lora/apply.py; export (toolkit/train/lora/export.py): merged weights for
final-hf, PEFT's files for final-hf-adapter.
"""

from __future__ import annotations

import dataclasses
import math
import zlib

import torch

from toolkit.adapters import transforms
from toolkit.adapters.transforms import HF_ARITY, Kind
from toolkit.errors import DsmtError

# megatron linear (within a layer) -> parallel mode of its base layer
LINEARS = {"self_attention.linear_qkv": "column", "self_attention.linear_proj": "row",
           "mlp.linear_fc1": "column", "mlp.linear_fc2": "row"}


class LoraError(DsmtError):
    """A LoRA setting this model or run cannot take."""


class LoraFamilyError(LoraError):
    """A model family whose layers dsmt's LoRA cannot adapt (its `fix` says what to do instead)."""

    rule = "lora_family"
    fix = ("fine-tune the model fully (remove training.lora), or LoRA-train it with a plain HF + PEFT loop "
           "(dsmt's LoRA adapts megatron's fused qkv / proj / fc1 / fc2 linears only)")


@dataclasses.dataclass(frozen=True)
class LoraModule:
    """One HF module PEFT would wrap: `hf_path` with `*` for the layer (model.layers.*.self_attn.q_proj), its
    megatron linear, the linear's transform kind, and which of the row's HF tensors it is (`slot`)."""

    hf_path: str
    linear: str  # a key of LINEARS
    kind: Kind
    slot: int

    @property
    def name(self) -> str:
        """The last name component: what PEFT's target_modules match."""
        return self.hf_path.rsplit(".", 1)[-1]

    def path_for(self, layer: int) -> str:
        return self.hf_path.replace("*", str(layer))


def family_modules(family) -> list[LoraModule]:
    """Every HF module of the family's attention and MLP linears, in weight-table order."""
    if family.is_encoder:
        raise LoraError(f"training.lora on {family.model_type} (an encoder): dsmt's LoRA supports the decoder "
                        "families (GPTModel chunks) only; fine-tune the encoder fully (remove training.lora)")
    if family.multimodal_settings is not None:  # toolkit/adapters/multimodal.py
        raise LoraFamilyError(f"training.lora on {family.model_type}: a multimodal checkpoint's PEFT adapter would "
                              "name its modules by target name alone, the vision tower's q_proj / fc1 included, and "
                              "dsmt writes the language model's paths in the checkpoint's naming, not PEFT's")
    rows = {row.megatron: row for row in family.weights}
    if "decoder.layers.*.self_attention.linear_kv_down_proj.weight" in rows:
        raise LoraFamilyError(f"training.lora on {family.model_type}: multi-latent attention's projections (q_a / "
                              "q_b / kv_a_proj_with_mqa / kv_b / o_proj) and the MoE experts take no LoRA adapter in "
                              "dsmt")
    if any(row.per_expert for row in family.weights):
        raise LoraFamilyError(f"training.lora on {family.model_type}: its MoE layers' experts, router and shared "
                              "experts take no LoRA adapter in dsmt (a mixture-of-experts MLP)")
    modules = []
    for linear in LINEARS:
        row = rows.get(f"decoder.layers.*.{linear}.weight")
        if row is None:
            raise LoraFamilyError(f"training.lora: the {family.model_type} weight table has no decoder.layers.*.{linear}"
                            ".weight row (a mixture-of-experts MLP?); dsmt's LoRA needs the dense layer")
        modules += [LoraModule(hf.removesuffix(".weight"), linear, row.kind, slot) for slot, hf in enumerate(row.hf)]
    return modules


def resolve_targets(family, targets: list[str] | None) -> list[LoraModule]:
    """The modules `training.lora.targets` select (None: all of them), matched by last name component as PEFT
    does. Raises LoraError naming the targets that match nothing and the available names."""
    modules = family_modules(family)
    if targets is None:
        return modules
    available = list(dict.fromkeys(module.name for module in modules))
    unknown = [target for target in targets if target not in available]
    if unknown:
        raise LoraError(f"training.lora.targets {unknown} match no {family.model_type} module; available: "
                        f"{', '.join(available)}")
    return [module for module in modules if module.name in targets]


def linear_shape(settings, linear: str) -> tuple[int, int]:
    """The layout-free megatron weight shape [out, in] of a layer's linear."""
    fields = settings.transformer_fields
    hidden, ffn = fields["hidden_size"], fields["ffn_hidden_size"]
    heads, groups, head_dim = fields["num_attention_heads"], fields["num_query_groups"], fields["kv_channels"]
    fc1_rows = ffn * (2 if fields.get("gated_linear_unit") else 1)
    return {"self_attention.linear_qkv": ((heads + 2 * groups) * head_dim, hidden),
            "self_attention.linear_proj": (hidden, heads * head_dim),
            "mlp.linear_fc1": (fc1_rows, hidden), "mlp.linear_fc2": (hidden, ffn)}[linear]


def module_shape(settings, module: LoraModule) -> tuple[int, int]:
    """The HF module's (out_features, in_features)."""
    shapes = transforms.expected_hf_shapes(module.kind, linear_shape(settings, module.linear),
                                           ctx=settings.shape_context())
    return tuple(shapes[module.slot])


def count_lora_params(hf_config, *, rank: int, targets: list[str] | None) -> int:
    """LoRA parameters of the whole model (every layer): r * (in + out) per targeted module (for the planner)."""
    from toolkit.adapters.hf_config import model_settings

    settings = model_settings(hf_config)
    per_layer = sum(rank * sum(module_shape(settings, m)) for m in resolve_targets(settings.family, targets))
    return per_layer * settings.num_layers


# ---- the megatron-layout matrices ---------------------------------------------------------------------------

def column_lora_matrices(*, kind: Kind, a: dict[int, torch.Tensor], b: dict[int, torch.Tensor],
                         out_rows: list[int], ctx, tp_rank: int, tp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A_all [k*r, in], B_local [local rows, k*r]) of a column-parallel linear from the targeted slots' A / B
    (slot -> tensor; `out_rows[slot]`: each HF tensor's rows). B_local @ A_all = this rank's shard of the fused
    delta, built with the weights' own `to_megatron` + `shard`."""
    slots = sorted(a)
    a_all = torch.cat([a[slot] for slot in slots], dim=0)
    width = a_all.shape[0]
    blocks, column = [], 0
    for slot in range(HF_ARITY[kind]):
        rows = out_rows[slot]
        if slot not in b:
            blocks.append(a_all.new_zeros(rows, width))
            continue
        rank = b[slot].shape[1]
        parts = [a_all.new_zeros(rows, column), b[slot], a_all.new_zeros(rows, width - column - rank)]
        blocks.append(torch.cat(parts, dim=1))
        column += rank
    full = transforms.to_megatron(kind, blocks, ctx=ctx)
    return a_all, transforms.shard(kind, full, tp_rank=tp_rank, tp_size=tp_size)


class LoraAdapter(torch.nn.Module):
    """The LoRA tensors of one megatron linear (one pair per targeted HF module, keyed by slot) and its delta."""

    def __init__(self, *, linear: str, kind: Kind, modules: dict[int, str], shapes: dict[int, tuple[int, int]],
                 out_rows: list[int], rank: int, alpha: float, dropout: float, ctx, tp_rank: int, tp_size: int,
                 sequence_parallel: bool, dtype: torch.dtype):
        super().__init__()
        self.linear, self.kind, self.parallel = linear, kind, LINEARS[linear]
        self.hf_paths = dict(modules)  # slot -> this layer's HF module path
        self.scaling, self.dropout = alpha / rank, dropout
        self.out_rows, self.ctx = list(out_rows), ctx
        self.tp_rank, self.tp_size, self.sequence_parallel = tp_rank, tp_size, sequence_parallel
        # Direct parameters, not a ParameterDict child: ZeRO-3 gathers for `forward` the module's own parameters only.
        for s in modules:
            self.register_parameter(f"lora_A_{s}", torch.nn.Parameter(torch.zeros(rank, shapes[s][1], dtype=dtype)))
            self.register_parameter(f"lora_B_{s}", torch.nn.Parameter(torch.zeros(shapes[s][0], rank, dtype=dtype)))
        for param in self.lora_A.values():
            param.tensor_parallel_partial_grad = tp_size > 1
        for param in self.lora_B.values():
            param.tensor_parallel_partial_grad = tp_size > 1 and (self.parallel == "column" or sequence_parallel)

    @property
    def lora_A(self) -> dict[str, torch.nn.Parameter]:
        """slot (as a string) -> A [r, in_features]."""
        return {str(s): getattr(self, f"lora_A_{s}") for s in self.hf_paths}

    @property
    def lora_B(self) -> dict[str, torch.nn.Parameter]:
        """slot (as a string) -> B [out_features, r]."""
        return {str(s): getattr(self, f"lora_B_{s}") for s in self.hf_paths}

    def matrices(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (A, B) in megatron layout: delta_local = scaling * B @ A."""
        a = {int(s): p for s, p in self.lora_A.items()}
        b = {int(s): p for s, p in self.lora_B.items()}
        if self.parallel == "column":
            return column_lora_matrices(kind=self.kind, a=a, b=b, out_rows=self.out_rows, ctx=self.ctx,
                                        tp_rank=self.tp_rank, tp_size=self.tp_size)
        (slot,) = a  # row-parallel linears are single HF modules
        return transforms.shard(Kind.ROW, a[slot], tp_rank=self.tp_rank, tp_size=self.tp_size), b[slot]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of scaling * B A x (the linear's output layout). Called as a module (`adapter(x)`), so
        that ZeRO-3's hooks gather A and B for it."""
        from megatron.core.tensor_parallel import mappings

        a, b = self.matrices()
        x = torch.nn.functional.dropout(x, p=self.dropout, training=self.training) if self.dropout else x
        if self.parallel == "column":
            x = (mappings.gather_from_sequence_parallel_region(x) if self.sequence_parallel
                 else mappings.copy_to_tensor_model_parallel_region(x))
            return self.scaling * torch.matmul(torch.matmul(x, a.t()), b.t())
        h = torch.matmul(x, a.t())
        h = (mappings.reduce_scatter_to_sequence_parallel_region(h) if self.sequence_parallel
             else mappings.reduce_from_tensor_model_parallel_region(h))
        return self.scaling * torch.matmul(h, b.t())

    @torch.no_grad()
    def merged_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """weight + scaling * B A in this rank's layout, computed in fp32, cast to the weight's dtype."""
        a, b = self.matrices()
        return (weight.float() + self.scaling * (b.float() @ a.float())).to(weight.dtype)


def lora_forward_hook(module, inputs, output):
    """Adds the adapter's delta to a megatron linear's output; returns (output, bias) as megatron's callers
    unpack it. The adapter is called as a module (ZeRO-3 gathers its parameters); nothing here reads the base
    weight."""
    out, bias, x = split_linear_output(output, linear_input=inputs[0])
    return out + module.lora(x).to(out.dtype), bias


def split_linear_output(output: tuple, *, linear_input: torch.Tensor):
    """(output, bias, LoRA input) of a megatron linear, by the arity of what it returned. Transformer Engine's
    layer-norm linear asked for its normalised input (`return_layernorm_output`, set by `attach`) returns
    ((output, normalised input), None), or, when it returns its bias (`te_return_bias`: a family with an fc1 bias,
    GPT-2), the flat (output, bias, normalised input) that megatron's wrapper passes on as TE gave it. The LoRA
    input is then that normalised input; for every other linear, (output, bias) and the linear's own input."""
    if len(output) == 3:
        out, bias, normalised = output
        return out, bias, normalised
    out, bias = output
    if isinstance(out, tuple):
        out, normalised = out
        return out, bias, normalised
    return out, bias, linear_input


def attach(linear_module: torch.nn.Module, adapter: LoraAdapter) -> None:
    if type(linear_module).__name__ == "TELayerNormColumnParallelLinear":
        # As Megatron-Bridge does: TE fuses the norm into the linear, so ask it for the normalised input too
        # (not gathered under SP: the hook gathers it, and its backward reduce-scatters the gradient).
        linear_module.return_layernorm_output = True
        linear_module.return_layernorm_output_gathered = False
    linear_module.lora = adapter
    linear_module._lora_hook = linear_module.register_forward_hook(lora_forward_hook)


def detach(linear_module: torch.nn.Module) -> LoraAdapter:
    """Undo `attach` (export: the checkpoint writer must see the plain linear); returns the adapter."""
    linear_module._lora_hook.remove()
    del linear_module._lora_hook
    adapter = linear_module._modules.pop("lora")
    if type(linear_module).__name__ == "TELayerNormColumnParallelLinear":
        linear_module.return_layernorm_output = False
    return adapter


def init_peft(param_a: torch.Tensor, *, seed: int, hf_path: str) -> None:
    """PEFT's initialisation of lora_A (kaiming_uniform, a=sqrt(5)) from a generator seeded by the run seed and
    the module's name: the same on every rank and for every layout. lora_B stays zero."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(hf_path.encode()))
    value = torch.empty(param_a.shape, dtype=torch.float32)
    torch.nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=generator)
    with torch.no_grad():
        param_a.copy_(value)


def adapted_linears(chunks: list):
    """(global layer index, linear name, megatron module) for every linear that carries an adapter."""
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            for linear in LINEARS:
                owner, attr = linear.split(".")
                module = getattr(getattr(layer, owner), attr, None)
                if module is not None and "lora" in module._modules:
                    yield layer.layer_number - 1, linear, module
