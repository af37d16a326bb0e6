"""LoRA on megatron-core chunks, with PEFT's own tensors: exact parity with `peft` and a trivial export.

One adapter per targeted HF module (q_proj, v_proj, down_proj, ...; GPT-2: c_attn, c_proj, c_fc; one per routed
expert for the fused experts' gate_up_proj / down_proj), found from the family's weight-table rows of the megatron
linears (toolkit/train/lora/targets.py `LINEARS`). Each adapter holds PEFT's tensors FULL and REPLICATED on every TP
rank, in HF orientation: lora_A [r, in], lora_B [out, r] (PEFT stores Conv1D LoRA the same way; a routed expert's
pair is its slice of PEFT's fused one, toolkit/adapters/peft_names.py). A forward hook on the megatron linear calls
the adapter (its own module, the `lora` child of the linear), which returns this rank's share of scaling * B A x, the
megatron-layout matrices being built in the forward with the SAME transforms as the weights (`column_lora_matrices`):

  column-parallel base (linear_qkv, linear_fc1, MLA's up projections), x the normalised input:
      A_all = cat(A of the targeted modules)                              [k*r, in]
      B_local = shard(kind, to_megatron(kind, [[B_q,0,0],[0,B_k,0],[0,0,B_v]]))  (zero blocks are constants;
                an untargeted module of the fused layer has no block)
      out_local += scaling * copy_to_tp(x) A_all^T B_local^T   (gather_from_sequence_parallel under SP)
      -> the gradients of A and B on each rank are partial: marked `tensor_parallel_partial_grad`, the engine sums
         them over TP (toolkit/train/engine/tp_grads.py `sequence_parallel_params`).
  row-parallel base (linear_proj, linear_fc2), x_local this rank's input columns:
      h = reduce_from_tp(x_local shard(ROW, A)^T)              (reduce_scatter_to_sequence_parallel under SP)
      out += scaling * h B^T
      -> A's gradient partial (marked); B's full and identical on every TP rank (partial under SP: marked then).
  duplicated base (MLA's q / kv down projections, whole on every TP rank): out += scaling * x A^T B^T, no
      communication; under SP each rank sees its sequence shard, so both gradients are partial (marked).
  the router (megatron's TopKRouter, whole on every TP rank): its `gating` wrapped to add scaling * x A^T B^T to
      the logits in the routing dtype; partial gradients under SP, as a duplicated linear's.
  a routed expert's linear (expert-column / expert-row): as column / row over the expert-TP group, but without the
      collectives: megatron's token dispatcher gathers the expert's tokens over expert-TP before its fc1 and sums
      fc2's partial outputs after, for the adapter's share as for the weight's; every gradient is then partial over
      expert-TP (marked). At EP > 1 the expert adapters are `allreduce=False`, DeepSpeed's mark of an expert
      parameter: reduced over the expert-data-parallel group only, as the experts (toolkit/train/engine/moe.py).
The LoRA parameters carry no `tensor_model_parallel` attribute: DeepSpeed counts them once in the grad norm.
scaling = alpha / rank (PEFT's default, not rslora); dropout on the LoRA input as PEFT does (not on experts: PEFT
refuses it there).
ZeRO-3 partitions the adapters and the frozen base weights alike. DeepSpeed gathers a module's OWN parameters in
its pre-forward hook (and again before that module's backward) and releases them after: the base linear's forward
reads only its weight, the adapter's forward only its A / B (direct parameters of `LoraAdapter`, not of a child
module), so both are whole exactly while in use, with DeepSpeed's prefetch. The merge and the adapter export read
them at export only, inside `params_on_cpu` (toolkit/adapters/zero3.py); `export.require_whole` checks it.
Applied to a rank's chunks by toolkit/train/lora/apply.py; export (toolkit/train/lora/export.py): merged weights for
final-hf, PEFT's files for final-hf-adapter.
"""

from __future__ import annotations

import contextlib
import functools
import math
import zlib

import torch

from toolkit.adapters import transforms
from toolkit.adapters.transforms import HF_ARITY, Kind
from toolkit.train.lora.targets import EXPERT_LINEARS, LINEARS

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
    """The LoRA tensors of one megatron linear (one pair per targeted HF module, keyed by slot) and its delta;
    `expert`: the global index of the routed expert whose linear it adapts (None for the other linears), whose
    `tp_rank` / `tp_size` are then the expert-TP group's."""

    def __init__(self, *, linear: str, kind: Kind, modules: dict[int, str], shapes: dict[int, tuple[int, int]],
                 out_rows: list[int], rank: int, alpha: float, dropout: float, ctx, tp_rank: int, tp_size: int,
                 sequence_parallel: bool, dtype: torch.dtype, expert: int | None = None):
        super().__init__()
        self.linear, self.kind, self.parallel, self.expert = linear, kind, LINEARS[linear], expert
        self.hf_paths = dict(modules)  # slot -> this layer's HF module path
        self.scaling, self.dropout = alpha / rank, dropout
        self.out_rows, self.ctx = list(out_rows), ctx
        self.disabled = False  # `adapters_disabled`: the base alone (DPO's reference under LoRA)
        self.tp_rank, self.tp_size, self.sequence_parallel = tp_rank, tp_size, sequence_parallel
        # Direct parameters, not a ParameterDict child: ZeRO-3 gathers for `forward` the module's own parameters only.
        for s in modules:
            self.register_parameter(f"lora_A_{s}", torch.nn.Parameter(torch.zeros(rank, shapes[s][1], dtype=dtype)))
            self.register_parameter(f"lora_B_{s}", torch.nn.Parameter(torch.zeros(shapes[s][0], rank, dtype=dtype)))
        partial_a, partial_b = self._partial_grads()
        for param in self.lora_A.values():
            param.tensor_parallel_partial_grad = partial_a
        for param in self.lora_B.values():
            param.tensor_parallel_partial_grad = partial_b

    def _partial_grads(self) -> tuple[bool, bool]:
        """Whether A's / B's gradient on one TP rank is a part to be summed over the (expert-)TP group (module
        docstring): every expert matrix at expert-TP > 1 (the dispatcher, not the linear, gathers the input and sums
        the output: each rank's gradient comes from its own slice); a duplicated linear's under sequence parallelism
        only (each rank its sequence shard)."""
        if self.tp_size == 1:
            return False, False
        if self.parallel in ("duplicated", "router"):
            return self.sequence_parallel, self.sequence_parallel
        return True, self.parallel in ("column", "expert-column", "expert-row") or self.sequence_parallel

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
        if self.parallel in ("column", "expert-column"):
            return column_lora_matrices(kind=self.kind, a=a, b=b, out_rows=self.out_rows, ctx=self.ctx,
                                        tp_rank=self.tp_rank, tp_size=self.tp_size)
        (slot,) = a  # row-parallel and duplicated linears are single HF modules
        if self.parallel in ("duplicated", "router"):
            return a[slot], b[slot]
        return transforms.shard(Kind.ROW, a[slot], tp_rank=self.tp_rank, tp_size=self.tp_size), b[slot]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of scaling * B A x (the linear's output layout). Called as a module (`adapter(x)`), so
        that ZeRO-3's hooks gather A and B for it. An expert's linear communicates nothing (megatron's dispatcher
        gathers its tokens over expert-TP before and sums its partial output after), nor does a duplicated one; so
        neither does their adapter."""
        from megatron.core.tensor_parallel import mappings

        a, b = self.matrices()
        x = torch.nn.functional.dropout(x, p=self.dropout, training=self.training) if self.dropout else x
        if self.parallel == "column":
            x = (mappings.gather_from_sequence_parallel_region(x) if self.sequence_parallel
                 else mappings.copy_to_tensor_model_parallel_region(x))
        h = torch.matmul(x, a.t())
        if self.parallel == "row":
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
    if module.lora.disabled:
        return out, bias
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


def router_gating(router, inputs: torch.Tensor) -> torch.Tensor:
    """megatron's router logits (in its routing dtype, fp32 for dsmt's families) plus the adapter's delta, added in
    that dtype: the router's own `gating` with LoRA, as PEFT adds the delta to HF's gate weight."""
    logits = type(router).gating(router, inputs)
    if router.lora.disabled:
        return logits
    delta = router.lora(inputs.to(router.lora.lora_A_0.dtype))
    return logits + delta.to(logits.dtype)


def attach(linear_module: torch.nn.Module, adapter: LoraAdapter) -> None:
    if adapter.parallel == "router":  # megatron's TopKRouter: its `gating` computes the logits (no linear module)
        linear_module.lora = adapter
        linear_module.gating = functools.partial(router_gating, linear_module)
        return
    if type(linear_module).__name__ == "TELayerNormColumnParallelLinear":
        # As Megatron-Bridge does: TE fuses the norm into the linear, so ask it for the normalised input too
        # (not gathered under SP: the hook gathers it, and its backward reduce-scatters the gradient).
        linear_module.return_layernorm_output = True
        linear_module.return_layernorm_output_gathered = False
    linear_module.lora = adapter
    linear_module._lora_hook = linear_module.register_forward_hook(lora_forward_hook)


def detach(linear_module: torch.nn.Module) -> LoraAdapter:
    """Undo `attach` (export: the checkpoint writer must see the plain linear); returns the adapter."""
    if linear_module.lora.parallel == "router":
        del linear_module.gating
        return linear_module._modules.pop("lora")
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


def layer_linears(layer, linear: str) -> list[tuple[int | None, torch.nn.Module]]:
    """(global expert index or None, megatron module) of a layer's linear (`LINEARS` name): one module, none where
    the layer lacks it (a dense layer's experts, an MoE layer's dense MLP), or every local expert's."""
    if linear in EXPERT_LINEARS:
        mlp = getattr(layer, "mlp", None)
        experts = getattr(getattr(mlp, "experts", None), "local_experts", None)
        if experts is None:
            return []
        attr = linear.rsplit(".", 1)[1]
        return [(index, getattr(expert, attr)) for index, expert in zip(mlp.local_expert_indices, experts)]
    module = layer
    for attr in linear.split("."):
        module = getattr(module, attr, None)
    return [] if module is None else [(None, module)]


def adapted_linears(chunks: list):
    """(global layer index, linear name, megatron module) for every linear that carries an adapter (each local
    expert's separately; its adapter's `expert` says which)."""
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            for linear in LINEARS:
                for _, module in layer_linears(layer, linear):
                    if "lora" in module._modules:
                        yield layer.layer_number - 1, linear, module


@contextlib.contextmanager
def adapters_disabled(chunks: list):
    """Every adapter of `chunks` off (each linear its base alone, as PEFT's `disable_adapter()`), restored after:
    DPO's reference under LoRA is the same model without its adapters, no second copy."""
    adapters = [module.lora for _, _, module in adapted_linears(chunks)]  # the routers' too ("mlp.router")
    for adapter in adapters:
        adapter.disabled = True
    try:
        yield len(adapters)
    finally:
        for adapter in adapters:
            adapter.disabled = False

