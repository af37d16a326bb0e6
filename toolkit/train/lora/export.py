"""LoRA in and out of PEFT's format, and the merged export (toolkit/train/lora/adapters.py holds the adapters).

  init      `read_init_adapter`: a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) checked
            against the spec's rank / alpha / targets and the model's shapes; one error lists everything wrong.
  merged    `merged_lora(chunks)`: inside, each adapted linear's weight is W + scaling * B A (fp32, cast back) in a
            new tensor and the adapters are detached, so the existing megatron-checkpoint -> HF export writes a
            plain model with the unchanged weight table; on exit the unmerged weights and adapters come back.
  adapter   `gather_peft_adapter` then `write_peft_adapter`: PEFT's files written by rank 0 from the layers of every
            PP stage (and VPP chunk), after the merged export (trained embeddings are read from it),
            keys as PEFT names them (base_model.model.<module>.lora_A.weight), config from peft's LoraConfig.
At ZeRO-3 both read whole tensors only inside `params_on_cpu` (toolkit/adapters/zero3.py: every parameter gathered into
a CPU copy); outside it a partitioned base weight or adapter is an empty shard, and `require_whole` raises.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from toolkit.adapters.load import full_shape
from toolkit.adapters.peft_names import (CONFIG_FILE, PEFT_PREFIX, WEIGHTS_FILE, expert_peft_key, join_expert_factors,
                                        peft_key, split_expert_factors)
from toolkit.train.lora.adapters import adapted_linears, attach, detach
from toolkit.train.lora.targets import LoraError, layers_with, module_shape, resolve_targets



def expert_path(path: str, expert: int) -> str:
    """dsmt's own name of one routed expert's slice of a fused parameter ('<fused parameter path>[e]', its A and B
    under '.lora_A' / '.lora_B'): how PEFT's fused pairs are split for the init adapter, and how the export gathers
    them before joining them back."""
    return f"{path}[{expert}]"


def expected_adapter(*, settings, modules, rank: int) -> dict[str, tuple[tuple[int, int], str, bool]]:
    """PEFT key -> (shape, '<hf module path>.lora_A' / '.lora_B', whether routed experts') of every tensor the run's
    adapter has; a routed experts' pair is PEFT's fused one ([r*E, in] / [out, r*E], toolkit/adapters/peft_names.py)."""
    expected = {}
    experts = settings.num_experts
    targeted = [module.hf_path.rsplit(".", 1)[1] for module in modules if module.expert]
    for module in modules:
        out_features, in_features = module_shape(settings, module)
        width = rank * experts if module.expert else rank
        for layer in layers_with(settings, module):
            path = module.path_for(layer)
            for matrix, shape in (("lora_A", (width, in_features)), ("lora_B", (out_features, width))):
                key = (expert_peft_key(path.rsplit(".", 1)[0], path.rsplit(".", 1)[1], matrix, targeted=targeted)
                       if module.expert else peft_key(path, matrix))
                expected[key] = (shape, f"{path}.{matrix}", module.expert)
    return expected


def read_init_adapter(path, *, settings, modules, lora) -> dict[str, torch.Tensor]:
    """'<hf module path>.lora_A' / '.lora_B' -> tensor from a PEFT adapter directory; LoraError listing every
    mismatch (rank, alpha, targets, missing / unexpected / mis-shaped tensors, unsupported PEFT options)."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
        raise LoraError(f"training.lora.init_adapter={path}: a PEFT adapter directory holds {CONFIG_FILE} and "
                        f"{WEIGHTS_FILE} (PeftModel.save_pretrained); found {sorted(p.name for p in path.glob('*'))}")
    config = json.loads((path / CONFIG_FILE).read_text())
    tensors = load_file(path / WEIGHTS_FILE)
    problems = []
    if config.get("r") != lora.rank:
        problems.append(f"r={config.get('r')} in the adapter, training.lora.rank={lora.rank}")
    if float(config.get("lora_alpha", -1)) != float(lora.alpha):
        problems.append(f"lora_alpha={config.get('lora_alpha')} in the adapter, training.lora.alpha={lora.alpha}")
    if config.get("modules_to_save"):
        problems.append(f"modules_to_save={config['modules_to_save']}: dsmt starts trained embeddings from the base "
                        "checkpoint only; merge this adapter into the model (PeftModel.merge_and_unload, then "
                        "save_pretrained) and fine-tune the merged checkpoint")
    for option, plain in (("use_rslora", False), ("use_dora", False), ("bias", "none")):
        if config.get(option, plain) != plain:
            problems.append(f"{option}={config.get(option)!r}: dsmt's LoRA supports {option}={plain!r} only")
    problems += _target_problems(config, modules)
    expected = expected_adapter(settings=settings, modules=modules, rank=lora.rank)
    for key, (shape, _, _) in expected.items():
        if key not in tensors:
            problems.append(f"{key} missing from {WEIGHTS_FILE}")
        elif tuple(tensors[key].shape) != shape:
            problems.append(f"{key} has shape {tuple(tensors[key].shape)}, expected {shape} (an adapter of another "
                            f"base model? base_model_name_or_path: {config.get('base_model_name_or_path')})")
    problems += [f"{key} in {WEIGHTS_FILE} is not an adapter of the run's targets" for key in sorted(set(tensors) - set(expected))]
    if problems:
        raise LoraError(f"training.lora.init_adapter={path} does not fit the run ({len(problems)} problem(s)):\n  - "
                        + "\n  - ".join(problems))
    initial = {name: tensors[key] for key, (_, name, expert) in expected.items() if not expert}
    return initial | _split_experts(tensors, expected=expected, num_experts=settings.num_experts)


def _target_problems(config: dict, modules) -> list[str]:
    """The adapter's target_modules / target_parameters against the run's, and PEFT options dsmt does not train."""
    problems = []
    wanted_modules = sorted({module.name for module in modules if not module.parameter})
    wanted_parameters = sorted({module.name for module in modules if module.parameter})
    targets = config.get("target_modules") or []
    if not isinstance(targets, list) or sorted(set(targets)) != wanted_modules:
        problems.append(f"target_modules={config.get('target_modules')} in the adapter, the run targets "
                        f"{wanted_modules} (set training.lora.targets to the adapter's list)")
    parameters = config.get("target_parameters") or []
    if sorted(set(parameters)) != wanted_parameters:
        problems.append(f"target_parameters={config.get('target_parameters')} in the adapter, the run targets "
                        f"{wanted_parameters} (set training.lora.targets to the adapter's targets)")
    for option in ("rank_pattern", "alpha_pattern"):
        if config.get(option):
            problems.append(f"{option}={config[option]}: dsmt trains one rank and alpha for every module (PEFT "
                            "writes per-module ones when it converts a transformers-4 MoE adapter: merge it into "
                            "the model instead)")
    return problems


def _split_experts(tensors: dict, *, expected: dict, num_experts: int) -> dict[str, torch.Tensor]:
    """'<fused experts parameter path>[e].lora_A' / '.lora_B' -> expert e's A / B, from PEFT's fused pairs."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, (_, name, expert) in expected.items():
        if expert:
            path, matrix = name.rsplit(".", 1)
            pairs.setdefault(path, {})[matrix] = tensors[key]
    found = {}
    for path, pair in pairs.items():
        factors = split_expert_factors(pair["lora_A"], pair["lora_B"], num_experts=num_experts)
        for expert, (a, b) in enumerate(factors):
            found[f"{expert_path(path, expert)}.lora_A"] = a.clone()
            found[f"{expert_path(path, expert)}.lora_B"] = b.clone()
    return found


def require_whole(module: torch.nn.Module, *, what: str) -> None:
    """Raise unless every parameter of `module` holds its whole tensor (a ZeRO-3 parameter outside a gather holds
    an empty shard: reading it would merge or export garbage, silently)."""
    for name, param in module.named_parameters():
        if tuple(param.data.shape) != full_shape(param):
            raise LoraError(f"{what}: {name} holds {tuple(param.data.shape)} of its {full_shape(param)} (a ZeRO-3 "
                            "partition); read it inside toolkit.adapters.zero3.params_on_cpu (as run._export does)")


@contextlib.contextmanager
def merged_lora(chunks: list):
    """Inside: every adapted linear holds its merged weight (a new tensor) and no adapter. Collective-free. At
    ZeRO-3, enter it inside `params_on_cpu`."""
    saved = []
    try:
        for _, _, module in adapted_linears(chunks):
            require_whole(module, what="LoRA merge")  # the base weight and (recursively) the adapter
            merged = module.lora.merged_weight(module.weight.data)
            saved.append((module, module.weight.data, detach(module)))
            module.weight.data = merged
        yield
    finally:
        for module, weight, adapter in saved:
            module.weight.data = weight
            attach(module, adapter)


def local_adapter_state(chunks: list, *, dense: bool = True, experts: bool = True) -> dict[str, torch.Tensor]:
    """PEFT key -> CPU copy of every adapter tensor of this rank's layers (full on every TP rank), of the other
    linears (`dense`) and / or of the local routed experts (`experts`), these under '<fused parameter path>[e]
    .lora_A' (`join_experts` makes PEFT's pairs of them)."""
    state = {}
    for _, _, module in adapted_linears(chunks):
        adapter = module.lora
        if not (experts if adapter.expert is not None else dense):
            continue
        require_whole(adapter, what="LoRA adapter export")
        for slot, path in adapter.hf_paths.items():
            for matrix, params in (("lora_A", adapter.lora_A), ("lora_B", adapter.lora_B)):
                key = (peft_key(path, matrix) if adapter.expert is None
                       else f"{expert_path(path, adapter.expert)}.{matrix}")
                state[key] = params[str(slot)].detach().to("cpu", copy=True)
    return state


def join_experts(state: dict, *, settings, modules, rank: int) -> dict[str, torch.Tensor]:
    """`state` with every routed experts' per-expert A / B replaced by PEFT's fused pair (all experts present)."""
    joined = {key: value for key, value in state.items() if key.startswith(PEFT_PREFIX)}
    for key, (_, name, expert) in expected_adapter(settings=settings, modules=modules, rank=rank).items():
        if expert and name.endswith(".lora_A"):
            path = name.removesuffix(".lora_A")
            factors = [(state[f"{expert_path(path, e)}.lora_A"], state[f"{expert_path(path, e)}.lora_B"])
                       for e in range(settings.num_experts)]
            joined[key], joined[key.replace(".lora_A.", ".lora_B.")] = join_expert_factors(factors)
    return joined


def embedding_names(settings) -> tuple[str, str]:
    """HF tensor names of the input embedding and the output layer (its untied row, also for a tied model)."""
    embedding = next(row.hf[0] for row in settings.family.weights if row.megatron == "embedding.word_embeddings.weight")
    return embedding, settings.family.untied_output.hf[0]


def peft_config(*, settings, modules, lora, base_model: str):
    """peft's own LoraConfig for the run's adapter; with trained embeddings their modules as `modules_to_save`
    (a tied pair: the embedding, kept tied to the output layer by `ensure_weight_tying`, as peft writes it)."""
    from peft import LoraConfig

    extra = {}
    if lora.train_embeddings:
        embedding, output = (name.removesuffix(".weight") for name in embedding_names(settings))
        extra = {"modules_to_save": [embedding.rsplit(".", 1)[-1]] + ([] if settings.tied_embeddings
                                                                     else [output.rsplit(".", 1)[-1]]),
                 "ensure_weight_tying": settings.tied_embeddings}
    parameters = sorted({module.name for module in modules if module.parameter})
    if parameters:
        extra["target_parameters"] = parameters
    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=sorted({module.name for module in modules if not module.parameter}), bias="none",
                      task_type="CAUSAL_LM", base_model_name_or_path=base_model,
                      fan_in_fan_out=any(row.transposed for row in settings.family.weights
                                         if row.megatron.endswith("linear_qkv.weight")), **extra)


def gather_peft_adapter(chunks: list, *, settings, lora) -> dict[str, torch.Tensor] | None:
    """The LoRA matrices of every pipeline stage, on rank 0 (None elsewhere): the other linears' from the TP-rank-0,
    DP-rank-0 rank of each stage, the routed experts' from the expert-TP-rank-0, expert-DP-rank-0 rank of each EP
    rank (the tensors are full on every (expert-)TP rank). Collective. At ZeRO-3, call it inside `params_on_cpu`."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dense = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank(with_context_parallel=True) == 0
    experts = ps.get_expert_tensor_parallel_rank() == 0 and ps.get_expert_data_parallel_rank() == 0
    local = local_adapter_state(chunks, dense=dense, experts=experts)
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local, gathered, dst=0)
    if dist.get_rank() != 0:
        return None
    modules = resolve_targets(settings.family, lora.targets, rows=settings.rows)
    state = join_experts({key: value.contiguous() for part in gathered for key, value in part.items()},
                         settings=settings, modules=modules, rank=lora.rank)
    expected = set(expected_adapter(settings=settings, modules=modules, rank=lora.rank))
    if set(state) != expected:
        raise LoraError(f"adapter export gathered {len(state)} tensors, expected {len(expected)}; missing: "
                        f"{sorted(expected - set(state))[:5]}")
    return state


def write_peft_adapter(state: dict, *, settings, lora, out_dir: Path, base_model: str, hf_dir: Path) -> None:
    """Write final-hf-adapter (rank 0): peft's config and the LoRA matrices and, with trained embeddings, their
    tensors as peft saves `modules_to_save` (base_model.model.<module>.weight; a tied pair under both names), read
    from the merged export `hf_dir`, so the embeddings are gathered and unpadded once. Written into a temporary
    directory renamed at the end: a failure leaves no adapter that looks whole."""
    import shutil

    from safetensors.torch import save_file

    state = dict(state)
    if lora.train_embeddings:
        state.update(trained_embeddings(settings=settings, hf_dir=hf_dir))
    out_dir = Path(out_dir)
    partial = out_dir.with_name(f".{out_dir.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    modules = resolve_targets(settings.family, lora.targets, rows=settings.rows)
    peft_config(settings=settings, modules=modules, lora=lora, base_model=base_model).save_pretrained(partial)
    save_file(dict(sorted(state.items())), partial / WEIGHTS_FILE, metadata={"format": "pt"})
    shutil.rmtree(out_dir, ignore_errors=True)
    partial.rename(out_dir)


def trained_embeddings(*, settings, hf_dir: Path) -> dict[str, torch.Tensor]:
    """PEFT key -> the trained embedding (and untied output layer) of the exported HF checkpoint `hf_dir`."""
    from safetensors import safe_open

    embedding, output = embedding_names(settings)
    wanted = {embedding: embedding} | {output: (embedding if settings.tied_embeddings else output)}
    found = {}
    for path in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(path, framework="pt") as tensors:
            for key, source in wanted.items():
                if source in tensors.keys():
                    # a copy each: a tied pair read twice shares the file's storage, which safetensors refuses
                    found[f"{PEFT_PREFIX}{key}"] = tensors.get_tensor(source).clone()
    if len(found) != len(wanted):
        raise LoraError(f"training.lora.train_embeddings: {sorted(set(wanted.values()))} not all found in the "
                        f"export {hf_dir}: the adapter would miss trained embeddings")
    return found


def init_adapter_problems(*, spec, settings) -> list:
    """For `dsmt check` and `dsmt train --dry-run`: training.lora.init_adapter read and compared with the run's
    targets and shapes, as every rank will at start-up; a warning when it names another base model than the run's
    (shapes decide: a moved or re-downloaded checkpoint keeps its adapters)."""
    from toolkit.errors import Problem

    lora = spec.training.lora
    if lora is None or lora.init_adapter is None or settings is None:
        return []
    try:
        read_init_adapter(lora.init_adapter, settings=settings, lora=lora,
                          modules=resolve_targets(settings.family, lora.targets, rows=settings.rows))
    except LoraError as err:
        return [Problem("error", "lora_init_adapter", str(err), "train a fresh adapter (unset init_adapter), or "
                        "set training.lora to the adapter's rank, alpha and targets")]
    problems = [Problem("info", "lora_init_adapter", f"training.lora.init_adapter={lora.init_adapter} fits the "
                        f"model (rank {lora.rank})")]
    made_for = json.loads((Path(lora.init_adapter).expanduser() / CONFIG_FILE).read_text()).get("base_model_name_or_path")
    model = spec.model.path
    if made_for and model and Path(made_for).expanduser().resolve() != Path(model).expanduser().resolve():
        problems.append(Problem("warning", "lora_init_adapter_base", f"training.lora.init_adapter="
                                f"{lora.init_adapter} was made for base_model_name_or_path={made_for}, this run's "
                                f"model.path is {model}; every tensor's shape fits",
                                "check that model.path is the checkpoint the adapter was trained on"))
    return problems
