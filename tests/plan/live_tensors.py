"""Counting the bytes of live tensors: a DeepSpeed engine's model states by category, and a forward's activations.

Model states. Every tensor reachable from the engine's optimizer (DeepSpeed and torch.optim objects, their lists,
dicts and `.grad`s) and from the model's parameters (data, `.grad`, `ds_tensor`, DeepSpeed's attributes) is found
with the path that reaches it, and counted once per storage. RULES below name, path by path, which category a
storage belongs to; a storage reached by several paths takes the first category in PRECEDENCE (a gradient view into
a reduce bucket is a buffer; the model parameters the optimizer also lists are parameters). What no rule names is
"unclassified" and reported, so a buffer DeepSpeed adds in a later release shows up instead of being missed.

Activations. `measure_forward` runs one forward + loss of a megatron-core chunk and reports (1) the bytes autograd
saves for backward (saved_tensors_hooks, distinct storages, parameters excluded), attributed to the layers, the
embedding and the output layer + loss by the module running when they were saved, and (2) the peak of the bytes of
storages allocated since the forward began and still alive (a TorchDispatchMode sees every allocation; a weak
reference tells when each storage is freed), which also catches the loss's temporary fp32 copies.
"""

from __future__ import annotations

import re

import torch

CATEGORIES = ("parameters", "gradients", "optimizer", "buffers", "unclassified")
PRECEDENCE = ("parameters", "optimizer", "buffers", "gradients", "unclassified")
RULES = (  # (category, regular expression on the path), first match wins
    # ZeRO-2 with overlap_comm and contiguous_gradients off (not dsmt's default): gradients of other ranks'
    # partitions released one bucket later (`previous_reduced_grads`): a reduce buffer rather than model state
    ("buffers", r"previous_reduced_grads\[.*\.grad$"),
    ("gradients", r"\.grad$|^param\.(grad|grad_accum|_hp_grad)$"),
    ("parameters", r"^param\.(data|ds_tensor|data\(persistent\))$"),
    ("buffers", r"^param\.data\(gathered\)$"),  # ZeRO-3: a partitioned parameter gathered whole for compute
    ("buffers", r"ipg_bucket|ipg_buffer|ipg_index|_muon_allgather"),  # reduce buckets
    # the flat buffers the parameters are views into (lists of the parameters themselves are left to the parameter
    # walk, which tells a ZeRO-3 parameter's gathered data from its partition)
    ("parameters", r"bit16_groups_flat|bf16_groups_flat|bf16_partitioned_groups|fp16_partitioned_groups_flat"),
    ("gradients", r"averaged_gradients|all_grad_tensors|grads_in_partition|fp32_groups_gradient|non_expert_gradients"
                  r"|grad_partitions_flat_buffer|param_id_to_grad_partition|grad_accum"),
    ("optimizer", r"single_partition_of_fp32_groups|fp32_groups_flat_partition|fp32_partitioned_groups_flat"
                  r"|\.fp32_groups\b|param_groups\[\d+\]\[params\]|\.state\["),
)
SMALL_BYTES = 64  # scalars (grad norms, overflow flags): below this a tensor is left out of every category


def category_of(path: str) -> str:
    for category, pattern in RULES:
        if re.search(pattern, path):
            return category
    return "unclassified"


def _walk(obj, path: str, found: list, seen: set, depth: int = 0) -> None:
    if depth > 10:
        return
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "meta":
            return
        if obj.grad is not None:
            _walk(obj.grad, path + ".grad", found, seen, depth + 1)
        storage = obj.untyped_storage()
        if storage.nbytes() >= SMALL_BYTES:
            found.append((storage.data_ptr(), storage.nbytes(), path))
        return
    if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None), torch.nn.Module)):
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        for key, value in list(obj.items()):
            _walk(value, f"{path}[{key if isinstance(key, (int, str)) else type(key).__name__}]", found, seen,
                  depth + 1)
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            _walk(value, f"{path}[{index}]", found, seen, depth + 1)
    elif type(obj).__module__.startswith(("deepspeed", "torch.optim")) and hasattr(obj, "__dict__"):
        for key, value in list(vars(obj).items()):
            if key not in ("module", "mpu", "param_names"):
                _walk(value, f"{path}.{key}", found, seen, depth + 1)


def _param_data_path(param) -> str:
    if not hasattr(param, "ds_id"):
        return "param.data"
    return "param.data(persistent)" if getattr(param, "ds_persist", False) else "param.data(gathered)"


def classify(engine) -> dict[str, int]:
    """Bytes per category of the distinct storages the engine holds now."""
    found, seen = [], set()
    for param in engine.module.parameters():
        if param.numel():
            _walk(param.data, _param_data_path(param), found, seen)
        for name in ("grad", "ds_tensor", "grad_accum", "_hp_grad"):
            value = getattr(param, name, None)
            if isinstance(value, torch.Tensor):
                _walk(value, f"param.{name}", found, seen)
    _walk(engine.optimizer, "opt", found, seen)
    storages: dict[int, tuple[int, str]] = {}
    for pointer, nbytes, path in found:
        category = category_of(path)
        known = storages.get(pointer)
        if known is None or PRECEDENCE.index(category) < PRECEDENCE.index(known[1]):
            storages[pointer] = (nbytes, category)
    totals = dict.fromkeys(CATEGORIES, 0)
    for nbytes, category in storages.values():
        totals[category] += nbytes
    return totals


class Moments:
    """Samples `classify` at the moments where DeepSpeed's model states peak: entering the gradient reduction
    (every micro-batch's gradients accumulated), entering the wrapper's and the torch optimizer's step (the fp32
    gradient partitions exist), and after the step. `peaks()`: each category's largest sample."""

    def __init__(self, engine):
        self.engine, self.samples = engine, []
        self.param_count = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
        self._wrap(engine, "allreduce_gradients", "reduce")
        if engine.optimizer is not engine.basic_optimizer:
            self._wrap(engine.optimizer, "step", "wrapper step")
        self._wrap(engine.basic_optimizer, "step", "optimizer step")

    def _wrap(self, owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        def sampled(*args, **kwargs):
            self.sample(label)
            return original(*args, **kwargs)

        setattr(owner, name, sampled)

    def sample(self, label: str) -> None:
        self.samples.append((label, classify(self.engine)))

    def peaks(self) -> dict[str, int]:
        return {category: max(totals[category] for _, totals in self.samples) for category in CATEGORIES}

    def totals(self) -> list[tuple[str, int]]:
        return [(label, sum(totals[c] for c in CATEGORIES)) for label, totals in self.samples]

    def unclassified(self) -> int:
        return self.peaks()["unclassified"]


class BuildTracker:
    """Peak parameter data (whole tensors plus ZeRO-3 partitions), in bytes and in elements, while chunks are built
    and loaded, sampled whenever a parameter is registered (a module under construction) and inside every ZeRO-3
    gather (the load writes one gathered parameter at a time). Parameters are the only model-sized allocations of
    build and load. Used here and by tests/train/engine/test_train_zero3.py's rank probe."""

    def __init__(self):
        self.params, self.peak_bytes, self.peak_elements = [], 0, 0

    def sample(self) -> None:
        def held(param) -> int:
            partition = getattr(param, "ds_tensor", None)
            return param.data.numel() + (partition.numel() if partition is not None else 0)

        self.peak_bytes = max(self.peak_bytes, sum(held(p) * p.element_size() for p in self.params))
        self.peak_elements = max(self.peak_elements, sum(held(p) for p in self.params))

    def __enter__(self):
        import deepspeed

        self._register, self._enter = torch.nn.Module.register_parameter, deepspeed.zero.GatheredParameters.__enter__
        tracker, register, enter = self, self._register, self._enter

        def register_parameter(module, name, param):
            register(module, name, param)
            if param is not None and all(param is not p for p in tracker.params):
                tracker.params.append(param)
            tracker.sample()

        def gathered_enter(context):
            result = enter(context)
            tracker.sample()
            return result

        torch.nn.Module.register_parameter = register_parameter
        deepspeed.zero.GatheredParameters.__enter__ = gathered_enter
        return self

    def __exit__(self, *exc):
        import deepspeed

        torch.nn.Module.register_parameter = self._register
        deepspeed.zero.GatheredParameters.__enter__ = self._enter
        return False


class LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes of the storages allocated while the mode is on and still alive, and their peak. Storages that
    existed before (parameters, inputs) are named in `before` and never counted, views of them included."""

    def __init__(self, *, before: set[int]):
        super().__init__()
        from torch.multiprocessing.reductions import StorageWeakRef

        self._weak, self.before, self.storages, self.peak, self.marks = StorageWeakRef, before, {}, 0, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in torch.utils._pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                storage = tensor.untyped_storage()
                pointer, known = storage.data_ptr(), self.storages.get(storage.data_ptr())
                if pointer not in self.before and (known is None or known[1].expired()):
                    self.storages[pointer] = (storage.nbytes(), self._weak(storage))
        self.peak = max(self.peak, self.live())
        return out

    def live(self) -> int:
        return sum(nbytes for nbytes, ref in self.storages.values() if not ref.expired())

    def mark(self, name: str) -> None:
        self.marks[name] = self.live()


def _part_of(module_name: str) -> str:
    if module_name.startswith("decoder.layers.") or module_name == "decoder":  # "decoder": full recompute's inputs
        return "layers"
    if module_name.startswith("embedding"):
        return "embedding"
    return "output"  # final norm, output layer, and the loss outside any module


def measure_forward(chunk, *, batch: dict, vocab_size: int) -> dict:
    """One forward + loss + backward: the saved-for-backward bytes by part, and the live-bytes peak of the forward
    and of the whole step (the parameters' gradients are allocated beforehand, so backward adds to them in place
    and only activation memory and its gradients are counted)."""
    from toolkit.train.engine.loss import masked_token_loss_sum

    for param in chunk.parameters():
        param.grad = torch.zeros_like(param)
    before = {t.untyped_storage().data_ptr() for p in chunk.parameters() for t in (p, p.grad)}
    before |= {b.untyped_storage().data_ptr() for b in chunk.buffers()}
    before |= {t.untyped_storage().data_ptr() for t in batch.values()}
    saved: dict[int, tuple[int, str]] = {}
    stack, hooks = ["<loss>"], []

    def enter(name: str):
        return lambda module, args: stack.append(name)  # list.append returns None: the input is kept

    def leave(module, args, output) -> None:
        stack.pop()

    for name, module in chunk.named_modules():
        hooks += [module.register_forward_pre_hook(enter(name)), module.register_forward_hook(leave)]

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in before and storage.data_ptr() not in saved:
            saved[storage.data_ptr()] = (storage.nbytes(), _part_of(stack[-1]))
        return tensor

    tracker = LiveBytes(before=before)
    with tracker:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            logits = chunk(batch["tokens"], batch["position_ids"], None)
            loss = masked_token_loss_sum(logits, labels=batch["labels"], loss_mask=batch["loss_mask"])
        forward_peak = tracker.peak
        for hook in hooks:
            hook.remove()
        loss.backward()
        del logits, loss
    parts = {"layers": 0, "embedding": 0, "output": 0}
    for nbytes, part in saved.values():
        parts[part] += nbytes
    return {"saved": parts, "forward_peak": forward_peak, "peak": tracker.peak}
