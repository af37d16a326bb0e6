"""`dsmt convert merge-lora BASE ADAPTER OUT`: a PEFT LoRA adapter folded into its HF base checkpoint, written as a
plain HF checkpoint (same tensor names, shards, dtypes and side files as BASE).

What the adapter may hold (names: toolkit/adapters/peft_names.py):
    <module>.lora_A.weight [r, in] / .lora_B.weight [out, r]   W += scaling * B @ A  (transposed: fan_in_fan_out)
    <module>.weight (no lora_)                                  modules_to_save: replaces W whole
    <experts>[.base_layer].lora_A / lora_B                      target_parameters on fused experts: expert e of
        gate_up_proj adds B_e[:I] @ A_e to its gate and B_e[I:] @ A_e to its up tensor, down_proj B_e @ A_e to
        down; the disk names are the family's per-expert ones (linear_fc1 -> (gate, up), linear_fc2 -> (down,))
scaling = alpha / r (use_rslora: alpha / sqrt(r)), r and alpha per module through rank_pattern / alpha_pattern.

Streamed: the adapter is read whole (it is small); BASE one tensor at a time, shard by shard, each merged in fp32
and cast once to its own dtype; so peak memory is the adapter plus about one tensor. Everything is checked before
a byte is written, and OUT appears only when complete (checkpoint.atomic_output_dir).
"""

from __future__ import annotations

import dataclasses
import math
import re
import shutil
import sys
import time
from pathlib import Path

import torch

from toolkit.adapters.peft_names import EXPERT_PARAMETERS, PEFT_PREFIX, expert_peft_key, split_expert_factors
from toolkit.convert import checkpoint as ckpt
from toolkit.convert.peft_adapter import MergeLoraError, read_adapter, read_json
from toolkit.convert.progress import peak_rss_bytes
from toolkit.convert.raw_io import OpenFiles, pread_into, safetensors_entries, write_tensor_files

INDEX_FILE = "model.safetensors.index.json"
# Weight files of other formats beside the safetensors (stale once the safetensors are merged): not copied.
_OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".bin.index.json")
_EXPERT_ROWS = {"gate_up_proj": "decoder.layers.*.mlp.experts.*.linear_fc1.weight",
                "down_proj": "decoder.layers.*.mlp.experts.*.linear_fc2.weight"}


@dataclasses.dataclass(frozen=True)
class Update:
    """One low-rank delta of a base tensor: scaling * lora_b @ lora_a, transposed for a Conv1D (fan_in_fan_out)."""

    lora_a: torch.Tensor  # [r, in]
    lora_b: torch.Tensor  # [out, r]
    scaling: float
    transposed: bool = False


@dataclasses.dataclass
class MergePlan:
    replacements: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # modules_to_save
    updates: dict[str, list[Update]] = dataclasses.field(default_factory=dict)
    problems: list[str] = dataclasses.field(default_factory=list)

    def add(self, name: str, update: Update) -> None:
        self.updates.setdefault(name, []).append(update)


@dataclasses.dataclass(frozen=True)
class MergeSummary:
    out_dir: Path
    tensors_merged: int  # base tensors with a LoRA delta
    tensors_replaced: int  # modules_to_save tensors
    shards: int
    seconds: float
    peak_rss_bytes: int

    def line(self) -> str:
        return (f"dsmt convert merge-lora: {self.tensors_merged} tensors merged, {self.tensors_replaced} replaced, "
                f"{self.shards} shard(s) written, {self.seconds:.1f} s, peak memory "
                f"{self.peak_rss_bytes / 2**30:.2f} GiB -> {self.out_dir}")


def merge_lora(*, base_dir: Path, adapter_dir: Path, out_dir: Path, overwrite: bool = False,
               show_progress: bool = False) -> MergeSummary:
    """Merge the adapter in `adapter_dir` into the HF checkpoint `base_dir`, writing `out_dir`."""
    start = time.perf_counter()
    base_dir, adapter_dir, out_dir = Path(base_dir), Path(adapter_dir), Path(out_dir)
    ckpt.refuse_existing(out_dir, overwrite=overwrite)
    config, adapter = read_adapter(adapter_dir)
    shards = base_shards(base_dir)
    where = {name: (shard, entry) for shard in shards for name, entry in safetensors_entries(shard).items()}
    base_config = read_json(base_dir / "config.json")
    plan = plan_merge(config=config, adapter=adapter, shapes={n: e[1] for n, (_, e) in where.items()},
                      base_config=base_config)
    plan.problems += base_problems(base_dir=base_dir, out_dir=out_dir, base_config=base_config)
    side = side_file_names(base_dir, problems=plan.problems)
    if plan.problems:
        raise MergeLoraError(_problem_text(plan.problems, config=config, base_dir=base_dir, adapter_dir=adapter_dir))
    files = OpenFiles()
    try:
        with ckpt.atomic_output_dir(out_dir, overwrite=overwrite,
                                    needed_bytes=sum(s.stat().st_size for s in shards)) as temp_dir:
            _write_shards(shards, temp_dir, plan=plan, files=files, show_progress=show_progress)
            for name in side:
                shutil.copy2(base_dir / name, temp_dir / name)
    finally:
        files.close()
    return MergeSummary(out_dir, len(plan.updates), len(plan.replacements), len(shards),
                        time.perf_counter() - start, peak_rss_bytes())


def base_problems(*, base_dir: Path, out_dir: Path, base_config: dict) -> list[str]:
    """A quantized base (its deltas would be added to the codes, not to the dequantised weights), and an OUT that
    is BASE or holds it (`--overwrite` would remove the base)."""
    problems = []
    quantization = base_config.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else quantization
        problems.append(f"base {base_dir} is quantized (quantization_config: quant_method {method!r}): a LoRA delta "
                        "cannot be added to quantized codes; dequantize it first (`dsmt convert hf-to-mcore "
                        "--dequantize-fp8` / `--dequantize-mxfp4`, then `dsmt convert mcore-to-hf`) and merge into "
                        "that bf16 checkpoint")
    if base_dir.resolve().is_relative_to(out_dir.resolve()):
        problems.append(f"OUT {out_dir} is the base checkpoint or a folder above it; write the merged model elsewhere")
    return problems


def base_shards(base_dir: Path) -> list[Path]:
    """The safetensors files of an HF checkpoint: the index's shards, or model.safetensors."""
    if not (base_dir / "config.json").is_file():
        raise MergeLoraError(f"base checkpoint {base_dir} has no config.json; BASE must be an HF checkpoint folder "
                             "(save_pretrained writes config.json and model*.safetensors)")
    if (base_dir / INDEX_FILE).is_file():
        names = sorted(set(read_json(base_dir / INDEX_FILE).get("weight_map", {}).values()))
        missing = [name for name in names if not (base_dir / name).is_file()]
        if missing or not names:
            raise MergeLoraError(f"{base_dir / INDEX_FILE} names shards that are not in {base_dir}: {missing}; "
                                 "re-download the checkpoint")
        return [base_dir / name for name in names]
    if (base_dir / "model.safetensors").is_file():
        return [base_dir / "model.safetensors"]
    raise MergeLoraError(f"base checkpoint {base_dir} has no model.safetensors or {INDEX_FILE}; merge-lora reads "
                         "safetensors checkpoints: re-save the base with save_pretrained(..., safe_serialization=True)")


def side_file_names(base_dir: Path, *, problems: list[str]) -> list[str]:
    """Every top-level file of BASE but its weights (config, generation config, tokenizer, index, README...).
    Sub-folders are not copied (`original/` holds the unmerged weights in another format). A link that leads out of
    the checkpoint is a problem: its contents would be copied into OUT."""
    root = ckpt.checkpoint_root(base_dir)
    names = []
    for path in sorted(base_dir.iterdir()):
        if not path.is_file() or path.name.endswith((".safetensors", *_OTHER_WEIGHTS)):
            continue
        if not path.resolve().is_relative_to(root) and not ckpt.in_hub_blobs(path.resolve()):
            problems.append(f"{path} links outside the checkpoint ({path.resolve()}); replace the link with the "
                            "file it should be, or remove it")
        names.append(path.name)
    return names


def plan_merge(*, config: dict, adapter: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]],
               base_config: dict) -> MergePlan:
    """Which base tensor each adapter tensor changes, and how; every name and shape checked (`plan.problems`)."""
    plan, pairs = MergePlan(), {}
    for key, tensor in adapter.items():
        if not key.startswith(PEFT_PREFIX):
            plan.problems.append(f"adapter key {key} does not start with {PEFT_PREFIX!r}: not a PEFT LoRA adapter")
        elif match := re.fullmatch(r"(.+)\.(lora_A|lora_B)\.weight", key.removeprefix(PEFT_PREFIX)):
            pairs.setdefault(match[1], {})[match[2]] = tensor
        elif ".lora_" in key:
            plan.problems.append(f"adapter key {key}: {key.rsplit('.', 1)[-1]} is not supported by merge-lora "
                                 "(LoRA on linear layers and fused experts only); merge it with peft's "
                                 "merge_and_unload()")
        else:
            _plan_replacement(key, tensor, plan=plan, shapes=shapes, adapter=adapter, base_config=base_config)
    experts: dict[str, dict] = {}
    for module, pair in pairs.items():
        unwrapped = module.replace(".base_layer", "")
        on_disk = _router_on_disk(unwrapped, base_config=base_config)
        if len(pair) != 2:
            plan.problems.append(f"adapter module {module} has only {sorted(pair)}; lora_A and lora_B come in pairs")
        elif f"{on_disk}.weight" in shapes:
            # PEFT keys rank_pattern / alpha_pattern of a target parameter (the router) by its parameter's name
            targets = config.get("target_parameters") or []
            parameter = any(f"{unwrapped}.weight".endswith(target) for target in targets)
            _plan_linear(on_disk, pair, plan=plan, shapes=shapes, config=config,
                         pattern_key=f"{unwrapped}.weight" if parameter else unwrapped)
        else:
            experts.setdefault(unwrapped, {})[PEFT_PREFIX + module] = pair
    for module, wrapped in experts.items():
        _plan_experts(module, wrapped, plan=plan, shapes=shapes, config=config, base_config=base_config)
    return plan


def _plan_replacement(key: str, tensor: torch.Tensor, *, plan: MergePlan, shapes: dict, adapter: dict,
                      base_config: dict) -> None:
    """modules_to_save (and save_embedding_layers' `base_layer`) tensors: the base tensor of that name, replaced."""
    name = key.removeprefix(PEFT_PREFIX).replace(".base_layer", "")
    if name not in shapes:
        # ensure_weight_tying on a tied base saves lm_head beside the embedding it is tied to: the base has one
        tied = base_config.get("tie_word_embeddings") and any(
            other is not tensor and other.shape == tensor.shape and torch.equal(other, tensor)
            and other_key.removeprefix(PEFT_PREFIX) in shapes for other_key, other in adapter.items())
        if not tied:
            why = (" (the base ties its output layer to the input embedding, tie_word_embeddings: true; a head "
                   "trained apart from it cannot be merged into a tied checkpoint)"
                   if base_config.get("tie_word_embeddings") else "")
            plan.problems.append(f"adapter key {key} replaces {name}, which is not in the base checkpoint{why}")
    elif tuple(tensor.shape) != tuple(shapes[name]):
        plan.problems.append(f"adapter key {key} {list(tensor.shape)} != base {name} {list(shapes[name])}")
    else:
        plan.replacements[name] = tensor


def _router_on_disk(module: str, *, base_config: dict) -> str:
    """The checkpoint's own name of a module PEFT names by transformers 5's in-memory path: the router of a family
    whose checkpoints keep another name for it (Mixtral: model.layers.N.mlp.gate is block_sparse_moe.gate on
    disk), through the family table's router row; any other module as it is."""
    from toolkit.adapters.family import get_family, supported_model_types

    model_type = base_config.get("model_type")
    family = get_family(model_type) if model_type in supported_model_types() else None
    if family is None or family.peft_experts is None:
        return module
    router = re.escape(family.peft_experts.rsplit(".", 1)[0] + ".gate").replace(r"\*", r"(\d+)")
    match = re.fullmatch(router, module)
    row = next((row for row in family.weights if row.megatron == "decoder.layers.*.mlp.router.weight"), None)
    if match is None or row is None:
        return module
    return row.for_layer(int(match[1]))[1][0].removesuffix(".weight")


def _plan_linear(module: str, pair: dict, *, plan: MergePlan, shapes: dict, config: dict,
                 pattern_key: str | None = None) -> None:
    lora_a, lora_b = pair["lora_A"], pair["lora_B"]
    rank, scaling = _rank_and_scaling(config, key=pattern_key or module)
    transposed = bool(config.get("fan_in_fan_out"))
    base_shape = tuple(shapes[f"{module}.weight"])
    delta_shape = (lora_b.shape[0], lora_a.shape[-1])
    if lora_a.ndim != 2 or lora_b.ndim != 2 or lora_a.shape[0] != rank or lora_b.shape[-1] != rank or \
            (delta_shape[::-1] if transposed else delta_shape) != base_shape:
        plan.problems.append(f"adapter {PEFT_PREFIX}{module}: lora_A {list(lora_a.shape)}, lora_B "
                             f"{list(lora_b.shape)} (r={rank}{', fan_in_fan_out' if transposed else ''}) do not fit "
                             f"base {module}.weight {list(base_shape)}")
        return
    plan.add(f"{module}.weight", Update(lora_a, lora_b, scaling, transposed))


def _plan_experts(module: str, wrapped: dict, *, plan: MergePlan, shapes: dict, config: dict,
                  base_config: dict) -> None:
    """A fused experts module's LoRA pairs (one per targeted parameter, PEFT's nesting) onto the per-expert tensors
    the checkpoint keeps on disk, through the family's weight table."""
    family, layer = _experts_family(module, base_config=base_config, plan=plan)
    if family is None:
        return
    targets = config.get("target_parameters") or []
    targeted = [p for p in EXPERT_PARAMETERS
                if any(f"{module}.{p}" == t or f"{module}.{p}".endswith(f".{t}") for t in targets)]
    expected = {expert_peft_key(module, p, "lora_A", targeted=targeted).removesuffix(".lora_A.weight"): p
                for p in targeted}
    if set(wrapped) != set(expected):
        plan.problems.append(f"adapter modules {sorted(wrapped)} do not match target_parameters={targets} on the "
                             f"experts of {module} (expected {sorted(expected) or 'none'})")
        return
    rows = {row.megatron: row for row in family.weights}
    for key, parameter in expected.items():
        row = rows.get(_EXPERT_ROWS[parameter])
        if row is None or row.stacked_experts:
            plan.problems.append(f"{module}.{parameter}: the {family.model_type} weight table has no per-expert "
                                 f"row {_EXPERT_ROWS[parameter]}")
            continue
        _plan_expert_parameter(f"{module}.{parameter}", wrapped[key], row=row, layer=layer, plan=plan, shapes=shapes,
                               config=config)


def _experts_family(module: str, *, base_config: dict, plan: MergePlan):
    """(family, layer index) of a fused experts module path, or (None, None) with the problem recorded."""
    from toolkit.adapters.family import get_family, supported_model_types

    model_type = base_config.get("model_type")
    with_experts = [t for t in supported_model_types() if get_family(t).peft_experts]
    family = get_family(model_type) if model_type in supported_model_types() else None
    if family is None or not family.peft_experts:
        plan.problems.append(f"adapter module {module} has no base tensor {module}.weight, and dsmt maps fused "
                             f"experts only for model types {', '.join(with_experts)} (base model_type "
                             f"{model_type!r})")
        return None, None
    pattern = re.escape(family.peft_experts).replace(r"\*", r"(\d+)")
    match = re.fullmatch(pattern, module)
    if match is None:
        plan.problems.append(f"adapter module {module}: no base tensor {module}.weight, and not a fused experts "
                             f"module of {model_type} ({family.peft_experts})")
        return None, None
    return family, int(match[1])


def _plan_expert_parameter(target: str, pair: dict, *, row, layer: int, plan: MergePlan, shapes: dict,
                           config: dict) -> None:
    """One targeted expert parameter (gate_up_proj: rows [gate; up]; down_proj) of every expert of one layer."""
    rank, scaling = _rank_and_scaling(config, key=target)
    names = []
    while row.for_layer(layer, len(names))[1][0] in shapes:
        names.append(row.for_layer(layer, len(names))[1])
    lora_a, lora_b = pair["lora_A"], pair["lora_B"]
    num_experts = len(names)
    out_rows = sum(shapes[n][0] for n in names[0]) if names else 0
    in_cols = shapes[names[0][0]][1] if names else 0
    if not names or tuple(lora_a.shape) != (rank * num_experts, in_cols) or \
            tuple(lora_b.shape) != (out_rows, rank * num_experts):
        plan.problems.append(f"adapter {target}: lora_A {list(lora_a.shape)}, lora_B {list(lora_b.shape)} do not fit "
                             f"{num_experts} experts of r={rank} with base {row.hf} of layer {layer} "
                             f"[{out_rows}, {in_cols}] (expected lora_A {[rank * num_experts, in_cols]}, lora_B "
                             f"{[out_rows, rank * num_experts]})")
        return
    for (a, b), hf_names in zip(split_expert_factors(lora_a, lora_b, num_experts=num_experts), names):
        first = 0
        for name in hf_names:  # gate_up: B's rows [gate ; up]
            plan.add(name, Update(a, b[first:first + shapes[name][0]], scaling))
            first += shapes[name][0]


def _rank_and_scaling(config: dict, *, key: str) -> tuple[int, float]:
    """(r, scaling) of one module (`key`: its path, or the experts module path + parameter) as PEFT's LoRA model
    sets them: rank_pattern / alpha_pattern matched with peft's own get_pattern_key."""
    from peft.utils.other import get_pattern_key

    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    rank = rank_pattern.get(get_pattern_key(rank_pattern.keys(), key), config["r"])
    alpha = alpha_pattern.get(get_pattern_key(alpha_pattern.keys(), key), config["lora_alpha"])
    return rank, alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def merged_tensor(base: torch.Tensor, *, replacement: torch.Tensor | None, updates: list[Update]) -> torch.Tensor:
    """The base tensor with its replacement and deltas, computed in fp32 and cast once to the base dtype."""
    weight = base if replacement is None else replacement
    if not updates:
        return weight.to(base.dtype)
    # a copy unless weight is the fp32 base just read from disk (ours to change); never the adapter's own tensor
    merged = weight.to(torch.float32, copy=replacement is not None)
    for update in updates:
        delta = update.scaling * (update.lora_b.float() @ update.lora_a.float())
        merged += delta.T if update.transposed else delta
    return merged.to(base.dtype)


def _write_shards(shards: list[Path], temp_dir: Path, *, plan: MergePlan, files: OpenFiles,
                  show_progress: bool) -> None:
    """Every base shard rewritten under its own name, tensor by tensor in file order: each read, merged and written
    before the next is read. One writer call for all shards: its one worker thread keeps one malloc arena, where a
    thread per shard would leave each shard's freed tensors in an arena of its own."""
    makers, entries, files_out = [], [], []
    for shard in shards:
        first = len(entries)
        for name, (dtype, shape, offset) in sorted(safetensors_entries(shard).items(), key=lambda e: e[1][2]):
            makers.append(_maker(name, shard, dtype=dtype, shape=shape, offset=offset, plan=plan, files=files))
            entries.append((name, shape, dtype))
        files_out.append((temp_dir / shard.name, list(range(first, len(entries)))))
    progress = (lambda line: print(f"merge-lora: {line}", file=sys.stderr)) if show_progress else None
    write_tensor_files(makers, entries=entries, files=files_out, progress=progress)


def _maker(name: str, shard: Path, *, dtype: torch.dtype, shape: tuple[int, ...], offset: int, plan: MergePlan,
           files: OpenFiles):
    def make() -> torch.Tensor:
        base = torch.empty(shape, dtype=dtype)
        pread_into(files.fd(shard), base, offset=offset, path=shard)
        return merged_tensor(base, replacement=plan.replacements.get(name), updates=plan.updates.get(name, []))
    return make


def _problem_text(problems: list[str], *, config: dict, base_dir: Path, adapter_dir: Path) -> str:
    shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
    text = f"adapter {adapter_dir} does not fit base {base_dir} ({len(problems)} problem(s)):\n  " + "\n  ".join(shown)
    made_for = config.get("base_model_name_or_path")
    if made_for and Path(made_for).resolve() != base_dir.resolve():
        text += f"\nthe adapter was made for base_model_name_or_path={made_for!r}"
    return text + "\nfix: pass the base checkpoint the adapter was trained on (and any other fix named above)"
