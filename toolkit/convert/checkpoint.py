"""dsmt's megatron checkpoint directory, and writing any output directory atomically.

    <dir>/dsmt_checkpoint.json   what wrote it, for which model; read first, so foreign checkpoints fail clearly
    <dir>/hf/                    the source's config.json, generation config and tokenizer files
    <dir>/model/                 megatron-core dist_checkpointing (torch_dist): loads at any TP x PP (resharding)
    <dir>/hf_passthrough.safetensors   only where the model keeps HF tensors it does not load (DeepSeek-V3's
                                 multi-token prediction, `ModelSettings.passthrough_hf`): those tensors as published
                                 (toolkit/convert/passthrough.py); its export writes them back
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import sys
from pathlib import Path

import torch

from toolkit import __version__
from toolkit.errors import DsmtError, RuleError, disk_full_cause
from toolkit.launch.identity import pid_running

FORMAT_NAME = "dsmt-mcore"
FORMAT_VERSION = 1
METADATA_FILE = "dsmt_checkpoint.json"
# Files of an HF checkpoint that are not weights and travel with it both ways.
HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                 "chat_template.jinja", "chat_template.json",
                 # a multimodal checkpoint's processor (toolkit/adapters/multimodal.py): its export stays multimodal
                 "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")


# What marks a directory as a megatron checkpoint (dsmt's, or another tool's that dsmt then refuses by name).
MEGATRON_MARKERS = (METADATA_FILE, "model", "latest_checkpointed_iteration.txt", "metadata.json")


class CheckpointError(DsmtError):
    """A checkpoint directory that is not what the command expects."""


class SideFileOutsideSource(RuleError, CheckpointError):
    """A tokenizer / config side file that links outside its checkpoint (rule `side_file_outside_source`)."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def write_metadata(directory: Path, *, model_type: str, padded_vocab_size: int, vocab_pad_multiple: int,
                   params_dtype: torch.dtype, source: str, hf_tensor_dtypes: dict[str, str]) -> None:
    import megatron.core

    metadata = {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "dsmt_version": __version__,
        "megatron_core_version": megatron.core.__version__, "model_type": model_type,
        "params_dtype": dtype_name(params_dtype), "padded_vocab_size": padded_vocab_size,
        "vocab_pad_multiple": vocab_pad_multiple, "source": source,
        # Per HF tensor, so export restores each dtype exactly (megatron keeps e.g. torch-fallback norms in fp32).
        "hf_tensor_dtypes": hf_tensor_dtypes,
    }
    (directory / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n")


def read_metadata(directory: Path) -> dict:
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"megatron checkpoint {directory} does not exist")
    path = directory / METADATA_FILE
    if not path.is_file():
        hint = ""
        if (directory / "latest_checkpointed_iteration.txt").exists() or (directory / "metadata.json").exists():
            hint = " It looks like a Megatron-LM / dist_checkpointing checkpoint written by another tool."
        raise CheckpointError(
            f"{directory} has no {METADATA_FILE}, so it was not written by `dsmt convert hf-to-mcore`.{hint} "
            "Convert the original HF checkpoint with `dsmt convert hf-to-mcore HF_DIR OUT_DIR`."
        )
    try:
        metadata = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} is not readable JSON ({err})") from err
    if metadata.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{path} has format {metadata.get('format')!r}, expected {FORMAT_NAME!r}")
    if metadata.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} is format_version {metadata.get('format_version')!r} (written by dsmt "
            f"{metadata.get('dsmt_version')}); this dsmt {__version__} reads version {FORMAT_VERSION}: use a matching dsmt"
        )
    return metadata


def is_megatron_dir(path: Path) -> bool:
    return any((Path(path) / marker).exists() for marker in MEGATRON_MARKERS)


def drop_quantization_config(hf_dir: Path) -> None:
    """Remove `quantization_config` from `hf_dir`/config.json (the weights beside it are not quantised: dequantised
    on conversion), so transformers loads the export as the plain model it is."""
    path = Path(hf_dir) / "config.json"
    config = json.loads(path.read_text())
    if config.pop("quantization_config", None) is not None:
        path.write_text(json.dumps(config, indent=2) + "\n")


def side_files(source_dir: Path) -> list[str]:
    """The names of HF_SIDE_FILES that `source_dir` holds as files (a link counts when it resolves inside the
    checkpoint: `checkpoint_root`). Raises CheckpointError (`[side_file_outside_source]`) listing every link that
    leads elsewhere: its contents would be copied into the output (a merges.txt linked to /etc/passwd was)."""
    source_dir = Path(source_dir)
    root = checkpoint_root(source_dir)
    names, outside = [], []
    for name in HF_SIDE_FILES:
        path = source_dir / name
        if not path.is_file():  # follows links: absent, dangling, a folder, a FIFO or a device is not copied
            continue
        if path.resolve().is_relative_to(root) or in_hub_blobs(path.resolve()):
            names.append(name)
        else:
            outside.append(f"{path} -> {path.resolve()}")
    if outside:
        raise SideFileOutsideSource(
            f"{len(outside)} file(s) of {source_dir} link outside it ({root}): {'; '.join(outside)}; dsmt copies "
            "only the checkpoint's own files into its output", rule="side_file_outside_source",
            fix="replace each link with the file it should be (cp --remove-destination REAL_FILE LINK), or remove it")
    return names


def checkpoint_root(source_dir: Path) -> Path:
    """The folder a checkpoint's files may resolve into: the checkpoint folder itself, or for a snapshot of the HF
    hub cache the model's whole cache folder (`models--org--name/snapshots/<revision>/config.json` links to
    `../../blobs/<sha256>`)."""
    resolved = Path(source_dir).resolve()
    for folder in resolved.parents:  # a snapshot, or a folder inside one (snapshots/<revision>/sub)
        if folder.name == "snapshots" and folder.parent.name.startswith("models--"):
            return folder.parent
    return resolved


def in_hub_blobs(target: Path) -> bool:
    """A file of a Hugging Face hub cache's blob store (`models--org--name/blobs/<hash>`): what a snapshot's links
    and, before huggingface_hub 0.23, `--local-dir` downloads' links point at."""
    return target.parent.name == "blobs" and target.parent.parent.name.startswith("models--")


def copy_side_files(source_dir: Path, target_dir: Path) -> list[str]:
    """Copy the side files of `source_dir` (checked by `side_files`) into `target_dir`, link targets as files."""
    names = side_files(source_dir)
    target_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copy2(Path(source_dir) / name, target_dir / name)
    return names


def refuse_existing(out_dir: Path, *, overwrite: bool) -> None:
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise DsmtError(f"output directory {out_dir} already exists; choose another path or pass --overwrite")


@contextlib.contextmanager
def atomic_output_dir(out_dir: Path, *, overwrite: bool, needed_bytes: int | None = None):
    """Yield a temporary sibling of `out_dir`; it replaces `out_dir` only if the block completes. Temporaries of
    killed writes of `out_dir` are removed first (a line each on stderr). A disk without `needed_bytes` free, or
    one that fills while writing, raises `[disk_full]`, the temporary removed."""
    out_dir = Path(out_dir)
    refuse_existing(out_dir, overwrite=overwrite)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    for line in remove_stale_temporaries(out_dir):
        print(line, file=sys.stderr)
    refuse_too_small(out_dir, needed_bytes=needed_bytes)
    temp_dir = out_dir.with_name(f".{out_dir.name}.partial-{os.getpid()}")
    shutil.rmtree(temp_dir, ignore_errors=True)
    temp_dir.mkdir()
    try:
        yield temp_dir
    except BaseException as err:
        shutil.rmtree(temp_dir, ignore_errors=True)
        full = disk_full_error(err, out_dir=out_dir, needed_bytes=needed_bytes)
        if full is not None:
            raise full from err
        raise
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        out_dir.rename(old)
        temp_dir.rename(out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        temp_dir.rename(out_dir)


def remove_stale_temporaries(out_dir: Path) -> list[str]:
    """Remove what killed writes of `out_dir` left beside it: `.NAME.partial-PID` folders, and `.NAME.old-PID` once
    NAME is back in place, of processes no longer alive on this machine; one line per folder removed."""
    lines = []
    for path in sorted(out_dir.parent.glob(f".{glob.escape(out_dir.name)}.*-*")):
        kind, _, pid = path.name.removeprefix(f".{out_dir.name}.").partition("-")
        if kind not in ("partial", "old") or not pid.isdigit() or _alive(int(pid)) or not path.is_dir():
            continue
        if kind == "old" and not out_dir.exists():
            continue  # the previous output, moved aside by a run killed before it renamed the new one in
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())
        shutil.rmtree(path, ignore_errors=True)
        lines.append(f"removed {path} ({size / 1e6:,.1f} MB): left by a killed write of {out_dir} (process {pid})")
    return lines


def _alive(pid: int) -> bool:
    # ours (atomic_output_dir replaces its own), or not a process id: never removed
    return pid <= 0 or pid == os.getpid() or pid_running(pid)


def _disk_fix(directory: Path) -> str:
    return (f"fix: free space on the filesystem of {directory}, or write the output to a larger disk; then run the "
            "same command again")


def refuse_too_small(out_dir: Path, *, needed_bytes: int | None) -> None:
    """`[disk_full]` before any byte is written when the output's filesystem has less than `needed_bytes` free."""
    if needed_bytes is None:
        return
    free = shutil.disk_usage(out_dir.parent).free
    if free < needed_bytes:
        raise DsmtError(f"[disk_full] {out_dir} needs about {needed_bytes / 1e6:,.1f} MB (the tensors it holds) and "
                        f"{out_dir.parent} has {free / 1e6:,.1f} MB free; nothing was written\n"
                        f"{_disk_fix(out_dir.parent)}")


def disk_full_error(err: BaseException, *, out_dir: Path, needed_bytes: int | None) -> DsmtError | None:
    """`[disk_full]` when `err` came from a full disk (ENOSPC / EDQUOT anywhere in its chain); None otherwise."""
    cause = disk_full_cause(err)
    if cause is None:
        return None
    free = shutil.disk_usage(out_dir.parent).free
    needed = "unknown" if needed_bytes is None else f"about {needed_bytes / 1e6:,.1f} MB"
    said = str(cause).strip().splitlines()[-1][:200] if str(cause).strip() else ""
    return DsmtError(f"[disk_full] the disk filled while writing {out_dir} ({free / 1e6:,.1f} MB free now on "
                     f"{out_dir.parent}; the output needs {needed}); nothing of it was kept (the library said: "
                     f"{type(cause).__name__}: {said})\n{_disk_fix(out_dir.parent)}")

