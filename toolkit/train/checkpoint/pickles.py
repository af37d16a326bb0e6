"""A resume unpickles no code: every pickle of a checkpoint is checked against an allowlist of the exact classes
dsmt's checkpoints hold, and anything else is refused by name (rule `unsafe_checkpoint`) before it is built.

Why: a pickle names functions the unpickler calls (`__reduce__`), so loading a file with plain pickle runs whatever
code its writer chose. DeepSpeed 0.19's TorchCheckpointEngine.load calls `torch.load(..., weights_only=False)` for
every model and optimizer file of a tag, and torch.distributed.checkpoint reads the layout-free copy's `.metadata`
with `pickle.load`. The manifest does not help here: it catches damage, and whoever can write a crafted file can
write its manifest too. So: `unsafe_files` lists the globals of every pickle of a tag without building anything
(`dsmt checkpoint verify` and resume, before any load), and DeepSpeed's own loads go through torch's weights-only
unpickler (`deepspeed_loads_weights_only`), which builds nothing outside the allowlist whatever the scan saw.

What a dsmt checkpoint holds beyond torch's weights-only defaults (tensors, dicts, lists, OrderedDict, torch.Size,
dtypes), measured with `torch.serialization.get_unsafe_globals_in_checkpoint` over every file of the demo's
PP2 x DP2 ZeRO-1 run and of DeepSpeed engines at ZeRO 0-3 in fp32, bf16 and fp16 (model files: nothing):

    *_optim_states.pt   LossScaler (fp32, bf16) or DynamicLossScaler (fp16), ZeroStageEnum (the ZeRO stage),
                        fragment_address (ZeRO 1-2: where each parameter sits in the flat partition)
    layout-free/.metadata   torch.distributed.checkpoint's metadata dataclasses, torch.Size, dtypes, pathlib paths

dsmt's own `dsmt_rng_rank*.pt` is plain tensors and ints (torch.load(weights_only=True) directly), and megatron's
`common.pt` is read by torch.load with torch's weights-only default."""

from __future__ import annotations

import contextlib
import pickle
from pathlib import Path

from toolkit.errors import DsmtError

DEEPSPEED_GLOBALS = ("deepspeed.runtime.fp16.loss_scaler.LossScaler",
                     "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                     "deepspeed.runtime.zero.config.ZeroStageEnum",
                     "deepspeed.utils.tensor_fragment.fragment_address")
_DCP = "torch.distributed.checkpoint"
DCP_METADATA_GLOBALS = frozenset({
    f"{_DCP}.metadata.{name}" for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                           "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                           "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    f"{_DCP}.filesystem._StorageInfo", "torch.Size", "torch.serialization._get_layout", "pathlib.PosixPath",
    "pathlib.PurePosixPath"})


class UnsafeCheckpoint(DsmtError):
    """A checkpoint file whose pickle names a class or function outside the allowlist (rule `unsafe_checkpoint`)."""


def _refusal(path: Path, names: list[str], allowed) -> UnsafeCheckpoint:
    return UnsafeCheckpoint(
        f"[unsafe_checkpoint] {path} names {', '.join(names)} in its pickle, which a dsmt checkpoint never holds "
        f"(allowed beyond tensors and containers: {', '.join(sorted(allowed))}); loading it would run code the file "
        "chose, so nothing of it was loaded\nfix: resume only from checkpoints you trust; if this one is yours, "
        "copy the tag again from where it was written (`dsmt checkpoint verify` checks a copy)")


def load_weights_only(path, map_location=None):
    """`torch.load` of a DeepSpeed checkpoint file with weights_only=True and DEEPSPEED_GLOBALS allowed."""
    import importlib

    import torch

    classes = [getattr(importlib.import_module(name.rpartition(".")[0]), name.rpartition(".")[2])
               for name in DEEPSPEED_GLOBALS]
    try:
        with torch.serialization.safe_globals(classes):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        said = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        try:  # the names alone, read without building anything
            names = sorted(n for n in torch.serialization.get_unsafe_globals_in_checkpoint(path)
                           if n not in DEEPSPEED_GLOBALS)
        except (RuntimeError, ValueError, OSError):  # not a zip checkpoint: torch's own words name it
            names = []
        raise _refusal(Path(path), names or [said], DEEPSPEED_GLOBALS) from None


@contextlib.contextmanager
def deepspeed_loads_weights_only(engine):
    """While in the block, `engine.load_checkpoint` reads every file through `load_weights_only`: DeepSpeed
    reads model, optimizer and expert files through `engine.checkpoint_engine.load` (state_dict_factory, the ZeRO
    loaders, load_moe_state_dict), so that one method is replaced on this engine and put back after."""
    checkpoint_engine = getattr(engine, "checkpoint_engine", None)
    if checkpoint_engine is None:  # not a DeepSpeed engine (a test's stand-in)
        yield
        return
    own = vars(checkpoint_engine).get("load")
    checkpoint_engine.load = load_weights_only
    try:
        yield
    finally:
        if own is None:
            del checkpoint_engine.load
        else:
            checkpoint_engine.load = own


def unsafe_files(tag_dir: Path) -> list[tuple[str, str]]:
    """(file, what it names) for each pickle of `tag_dir` that names a class or function outside the allowlists,
    read without building anything of it (`.metadata`: built from allowed classes only). The same check for `dsmt
    checkpoint verify` and for resume (`refuse_unsafe`). Skipped, and left to the load: a `.pt` in torch's legacy format
    (DeepSpeed's `checkpoint_serialization: false`), which this scan cannot read and `load_weights_only` still
    refuses, and a pickle that fails for another reason than a global (it fails the same way at the load, having
    built nothing outside the allowlist on the way)."""
    import torch

    tag_dir = Path(tag_dir)
    found = []
    for path in sorted(tag_dir.rglob("*.pt")):
        try:
            names = sorted(name for name in torch.serialization.get_unsafe_globals_in_checkpoint(path)
                           if name not in DEEPSPEED_GLOBALS)
        except (RuntimeError, ValueError, OSError):
            continue
        if names:
            found.append((path.relative_to(tag_dir).as_posix(), f"names {', '.join(names)}"))
    for metadata in sorted(tag_dir.rglob(".metadata")):
        try:
            with open(metadata, "rb") as reader:
                _MetadataUnpickler(reader).load()
        except _Refused as err:
            found.append((metadata.relative_to(tag_dir).as_posix(), f"names {err}"))
        except Exception:  # any other failure is the load's to report (see the docstring)
            continue
    return found


def refuse_unsafe(tag_dir: Path) -> None:
    """UnsafeCheckpoint naming every file of `tag_dir` whose pickle `unsafe_files` names; before anything of the
    tag is loaded (rank 0, for every rank: no rank is left loading while another stops)."""
    lines = [f"{name}: {what}" for name, what in unsafe_files(tag_dir)]
    if lines:
        raise UnsafeCheckpoint(
            f"[unsafe_checkpoint] checkpoint {tag_dir} holds pickles that would run code when loaded, so nothing "
            f"of it was loaded:\n  " + "\n  ".join(lines) + "\nallowed beyond tensors and containers: "
            f"{', '.join(DEEPSPEED_GLOBALS)} and torch.distributed.checkpoint's metadata\nfix: resume only from "
            "checkpoints you trust: if this one is yours, copy the tag again from where it was written; or move "
            f"{tag_dir} aside to resume from the one before")


class _Refused(pickle.UnpicklingError):
    """A global outside the allowlist (other unpickling errors are torch's to report)."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        import torch

        qualified = f"{module}.{name}"
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if qualified in DCP_METADATA_GLOBALS or is_dtype:
            return super().find_class(module, name)
        raise _Refused(qualified)
