"""Streamed reads of an HF checkpoint's safetensors: headers first (names, shapes, dtypes), then one tensor at a
time, so conversion never holds the HF model and the megatron model together. Header handles stay open (they
touch only the headers); tensor reads use their own short-lived handle.

A quantised checkpoint (config.json `quantization_config`) is refused by name. With `dequantize_fp8=True` a
block-scaled FP8 checkpoint as DeepSeek-V3 publishes it is read as bf16: every FP8 weight `X.weight` comes with
`X.weight_scale_inv` (fp32, one value per `weight_block_size` block), and the source presents the dequantised bf16
tensor under the weight's name, the scale tensors consumed (not listed by `names()`). With `dequantize_mxfp4=True` an
MXFP4 checkpoint as GPT-OSS publishes it is read as bf16 the same way: each `X_blocks` / `X_scales` pair is presented
as transformers' parameter `X` (toolkit/adapters/mxfp4.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from toolkit.adapters import mxfp4
from toolkit.adapters.family import AdapterError
from toolkit.errors import RuleError

INDEX_NAME = "model.safetensors.index.json"
SCALE_SUFFIX = "_scale_inv"  # DeepSeek-V3: `X.weight` (fp8) has `X.weight_scale_inv` (fp32 block scales)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
DEQUANTIZED_DTYPE = torch.bfloat16  # what DeepSeek's own dequantisation (fp8_cast_bf16.py) writes
_FP8_FIX = "dsmt convert hf-to-mcore {dir} DST --dequantize-fp8"
MXFP4_METHOD = "mxfp4"
_MXFP4_FIX = "dsmt convert hf-to-mcore {dir} DST --dequantize-mxfp4"


class QuantizedCheckpointError(RuleError, AdapterError):
    """A quantised checkpoint dsmt does not read as it is: `[rule] message`, then the fix."""


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, *, block_size: tuple[int, int],
                          first_row: int = 0) -> torch.Tensor:
    """bf16 of `weight.float() * scale_inv` with each scale spread over its block of rows x columns (the last
    blocks of each dimension cut at the tensor's edge).

    `weight` may be a band of rows of the full tensor: then `scale_inv` holds the scale rows of the blocks the band
    touches, and `first_row` is the band's first row counted from the top of the first of those blocks."""
    if weight.dim() != 2 or scale_inv.dim() != 2:
        raise ValueError(f"block-scaled FP8 is 2-D: weight {tuple(weight.shape)}, scale_inv {tuple(scale_inv.shape)}")
    block_rows, block_cols = block_size
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(block_rows, dim=0)[first_row:first_row + rows]
    scale = scale.repeat_interleave(block_cols, dim=1)[:, :cols]
    if scale.shape != weight.shape:
        raise ValueError(f"scale_inv {tuple(scale_inv.shape)} in blocks of {list(block_size)} does not cover rows "
                         f"{first_row}..{first_row + rows} x {cols} columns")
    return (weight.float() * scale).to(DEQUANTIZED_DTYPE)


def fp8_scale_shape(shape: tuple[int, ...], *, block_size: tuple[int, int]) -> tuple[int, int]:
    """[ceil(rows / block rows), ceil(cols / block cols)]: the scale tensor of a 2-D FP8 weight."""
    return tuple(-(-size // block) for size, block in zip(shape, block_size))


def quantization_config(checkpoint_dir: Path) -> dict | None:
    """config.json's `quantization_config`, or None (also when config.json is absent or unreadable: the config
    loader names that problem)."""
    try:
        raw = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    quantization = raw.get("quantization_config") if isinstance(raw, dict) else None
    return quantization if isinstance(quantization, dict) else None


def fp8_block_size(quantization: dict | None, *, checkpoint_dir: Path, dequantize_fp8: bool) -> tuple[int, int] | None:
    """The FP8 block size to dequantise with; None for an unquantised checkpoint. Raises QuantizedCheckpointError
    for any other quantisation, and for FP8 without `dequantize_fp8`."""
    if quantization is None:
        return None
    method, fmt = quantization.get("quant_method"), quantization.get("fmt", "e4m3")
    block, activations = quantization.get("weight_block_size"), quantization.get("activation_scheme", "dynamic")
    if method == MXFP4_METHOD:
        raise QuantizedCheckpointError(
            f"{checkpoint_dir} stores MXFP4 expert weights (quantization_config.quant_method 'mxfp4', as GPT-OSS is "
            "published); dsmt trains and converts bf16 / fp16 / fp32 weights", rule="mxfp4_checkpoint",
            fix=f"dequantise it to bf16 once: `{_MXFP4_FIX.format(dir=checkpoint_dir)}`, then train from DST "
                "(or from its `dsmt convert mcore-to-hf DST HF_DIR` export)")
    if method != "fp8":
        raise QuantizedCheckpointError(
            f"{checkpoint_dir} is quantised (config.json quantization_config.quant_method={method!r}); dsmt reads "
            "unquantised weights (bf16 / fp16 / fp32), and --dequantize-fp8 / --dequantize-mxfp4 read block-scaled "
            "'fp8' / GPT-OSS's 'mxfp4' only",
            rule="quantized_checkpoint", fix="use the unquantised checkpoint this one was made from (the model's "
            "bf16 / fp16 release)")
    described = (f"{checkpoint_dir} stores FP8 weights (quantization_config: quant_method 'fp8', fmt {fmt!r}, "
                 f"weight_block_size {block}, activation_scheme {activations!r})")
    if not dequantize_fp8:
        raise QuantizedCheckpointError(
            f"{described}; dsmt trains and converts bf16 / fp16 / fp32 weights", rule="fp8_checkpoint",
            fix=f"dequantise it to bf16 once: `{_FP8_FIX.format(dir=checkpoint_dir)}`, then train from DST "
                "(or from its `dsmt convert mcore-to-hf DST HF_DIR` export)")
    valid_block = isinstance(block, (list, tuple)) and len(block) == 2 and all(
        isinstance(b, int) and b > 0 for b in block)
    if not valid_block or fmt not in ("e4m3", "e5m2") or activations != "dynamic":
        raise QuantizedCheckpointError(
            f"{described}: --dequantize-fp8 reads DeepSeek-V3's layout only: fmt 'e4m3' or 'e5m2', "
            "weight_block_size [rows, cols], activation_scheme 'dynamic' (no activation scale tensors)",
            rule="fp8_unsupported", fix="use the model's bf16 release")
    return int(block[0]), int(block[1])


@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """A stored FP8 weight the source presents dequantised: its scale tensor and the block size."""

    scale_name: str
    block_size: tuple[int, int]


def shard_files(checkpoint_dir: Path) -> list[Path]:
    """The safetensors files of `checkpoint_dir`: its index's shards (each present), else every *.safetensors."""
    index = checkpoint_dir / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as err:
            raise AdapterError(f"{index} is not a valid safetensors index ({err})") from err
        files = sorted({checkpoint_dir / f for f in weight_map.values()})
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise AdapterError(f"{index} lists shard files that are missing: {', '.join(missing)}")
        return files
    files = sorted(checkpoint_dir.glob("*.safetensors"))
    if not files:
        legacy = [p.name for p in checkpoint_dir.glob("*.bin")]
        hint = (f" It has {', '.join(legacy)}: re-save with model.save_pretrained(dir, safe_serialization=True)."
                if legacy else "")
        raise AdapterError(f"no *.safetensors weights in {checkpoint_dir}.{hint}")
    return files


UNREADABLE_FIX = "re-download or re-save the checkpoint (model.save_pretrained(dir, safe_serialization=True))"


def open_safetensors(path: Path):
    """safetensors' handle of `path`, its header read and checked against the file's size (no tensor data read);
    raises AdapterError naming the file."""
    try:
        handle = safe_open(str(path), framework="pt")
        handle.keys()
    except (SafetensorError, OSError, ValueError) as err:
        raise AdapterError(f"{path} is not a readable safetensors file ({err}); it may be truncated or corrupt: "
                           f"{UNREADABLE_FIX}") from err
    return handle


def unreadable_weight_files(checkpoint_dir: Path) -> list[str]:
    """Every problem with the safetensors files of `checkpoint_dir` (the index, missing shards, headers), each a
    sentence; [] when every file's header reads. Cheap: headers only (what `dsmt check` can afford for 140 GB)."""
    try:
        files = shard_files(checkpoint_dir)
    except AdapterError as err:
        return [str(err)]
    problems = []
    for path in files:
        try:
            open_safetensors(path)
        except AdapterError as err:
            problems.append(str(err))
    return problems


class SafetensorsSource:
    """Tensor name -> (file, shape, dtype) for a checkpoint directory; `get(name)` reads one tensor.

    Refuses a quantised checkpoint (QuantizedCheckpointError) unless it is block-scaled FP8 and `dequantize_fp8`:
    then FP8 weights read as bf16 and their `_scale_inv` tensors are not listed; or MXFP4 and `dequantize_mxfp4`:
    then each `X_blocks` / `X_scales` pair reads as the bf16 tensor `X`."""

    def __init__(self, checkpoint_dir: Path, *, dequantize_fp8: bool = False, dequantize_mxfp4: bool = False):
        self.checkpoint_dir = Path(checkpoint_dir)
        quantization = quantization_config(self.checkpoint_dir)
        is_mxfp4 = dequantize_mxfp4 and (quantization or {}).get("quant_method") == MXFP4_METHOD
        block_size = None if is_mxfp4 else fp8_block_size(quantization, checkpoint_dir=self.checkpoint_dir,
                                                          dequantize_fp8=dequantize_fp8)
        self._handles: dict[Path, object] = {}
        self._file_of: dict[str, Path] = {}
        for path in shard_files(self.checkpoint_dir):
            handle = self._open(path)
            for name in handle.keys():
                self._file_of[name] = path
        self._mxfp4: dict[str, mxfp4.Mxfp4Weight] = {}  # read by shape() / file_dtype() while pairing
        self._fp8 = self._pair_fp8(block_size) if block_size else {}
        self._mxfp4 = self._pair_mxfp4() if is_mxfp4 else {}
        consumed = {weight.scale_name for weight in self._fp8.values()}
        consumed |= {name for weight in self._mxfp4.values() for name in (weight.blocks_name, weight.scales_name)}
        self._names = sorted([name for name in self._file_of if name not in consumed] + list(self._mxfp4))

    def _open(self, path: Path):
        self._handles[path] = handle = open_safetensors(path)
        return handle

    def _pair_fp8(self, block_size: tuple[int, int]) -> dict[str, Fp8Weight]:
        """FP8 weight name -> its scale, after checking every pair (one error lists every problem)."""
        pairs, problems = {}, []
        for name in sorted(self._file_of):
            if name.endswith(SCALE_SUFFIX):
                weight = name.removesuffix(SCALE_SUFFIX)
                if weight not in self._file_of or self.file_dtype(weight) not in FP8_DTYPES:
                    problems.append(f"{name} scales no FP8 tensor {weight!r}")
                continue
            if self.file_dtype(name) not in FP8_DTYPES:
                continue
            scale, shape = name + SCALE_SUFFIX, self.shape(name)
            if scale not in self._file_of:
                problems.append(f"FP8 tensor {name} {list(shape)} has no {scale}")
            elif len(shape) != 2 or self.shape(scale) != fp8_scale_shape(shape, block_size=block_size):
                expected = list(fp8_scale_shape(shape, block_size=block_size)) if len(shape) == 2 else "a 2-D weight"
                problems.append(f"{scale} is {list(self.shape(scale))} for {name} {list(shape)} in blocks of "
                                f"{list(block_size)} (expected {expected})")
            else:
                pairs[name] = Fp8Weight(scale_name=scale, block_size=block_size)
        self._refuse_unpaired(problems, what="FP8 tensor(s) without matching block scales", rule="fp8_scales",
                              fix="re-download the checkpoint; check weight_block_size in config.json against the "
                                  "scale shapes")
        return pairs

    def _pair_mxfp4(self) -> dict[str, mxfp4.Mxfp4Weight]:
        """Presented name -> its MXFP4 blocks and scales, after checking every pair (one error lists every problem)."""
        entries = {name: (self.shape(name), self.file_dtype(name)) for name in self._file_of}
        pairs, problems = mxfp4.pair_mxfp4(entries)
        self._refuse_unpaired(problems, what="MXFP4 tensor(s) without matching blocks / scales", rule="mxfp4_tensors",
                              fix="re-download the checkpoint (GPT-OSS's release stores experts.*_blocks with "
                                  "experts.*_scales)")
        return pairs

    def _refuse_unpaired(self, problems: list[str], *, what: str, rule: str, fix: str) -> None:
        """One error listing every quantised tensor whose companion (scales, blocks) is missing or misshapen."""
        if problems:
            raise QuantizedCheckpointError(f"{self.checkpoint_dir}: {len(problems)} {what}:\n  - " + "\n  - ".join(problems),
                                           rule=rule, fix=fix)

    def names(self) -> list[str]:
        return list(self._names)

    def file_of(self, name: str) -> Path:
        weight = self._mxfp4.get(name)
        return self._file_of[weight.blocks_name if weight is not None else name]

    def files(self) -> list[Path]:
        """Every safetensors file of the checkpoint (also one holding only FP8 scales)."""
        return sorted(set(self._file_of.values()))

    def fp8_weight(self, name: str) -> Fp8Weight | None:
        """How `name` is dequantised on read; None for a tensor read as stored."""
        return self._fp8.get(name)

    def shape(self, name: str) -> tuple[int, ...]:
        weight = self._mxfp4.get(name)
        if weight is not None:
            return mxfp4.parameter_shape(self.shape(weight.blocks_name))
        return tuple(self._handles[self._file_of[name]].get_slice(name).get_shape())

    def file_dtype(self, name: str) -> torch.dtype | None:
        """The dtype in the file (FP8 for a weight `get` dequantises, uint8 for an MXFP4 one)."""
        weight = self._mxfp4.get(name)
        name = weight.blocks_name if weight is not None else name
        return _SAFETENSORS_DTYPES.get(self._handles[self._file_of[name]].get_slice(name).get_dtype(), None)

    def dtype(self, name: str) -> torch.dtype | None:
        """The dtype `get` returns."""
        if name in self._mxfp4:
            return mxfp4.DEQUANTIZED_DTYPE
        return DEQUANTIZED_DTYPE if name in self._fp8 else self.file_dtype(name)

    def nbytes(self, name: str) -> int:
        shape = self.shape(name)
        numel = 1
        for size in shape:
            numel *= size
        return numel * torch.empty((), dtype=self.dtype(name)).element_size()

    def get(self, name: str) -> torch.Tensor:
        weight = self._mxfp4.get(name)
        if weight is not None:
            return mxfp4.dequantize_experts(self._read(weight.blocks_name), self._read(weight.scales_name))
        fp8 = self._fp8.get(name)
        if fp8 is None:
            return self._read(name)
        return dequantize_fp8_blocks(self._read(name), self._read(fp8.scale_name), block_size=fp8.block_size)

    def get_expert(self, name: str, *, expert: int) -> torch.Tensor:
        """Slice `expert` (dim 0) of a tensor that stacks a layer's experts, read alone (an MXFP4 one dequantised)."""
        weight = self._mxfp4.get(name)
        if weight is not None:
            return mxfp4.dequantize_expert(self._read(weight.blocks_name, expert=expert),
                                           self._read(weight.scales_name, expert=expert))
        if name in self._fp8:
            return self.get(name)[expert]
        return self._read(name, expert=expert)

    def _read(self, name: str, *, expert: int | None = None) -> torch.Tensor:
        """The stored tensor `name`, or only its slice `expert` on dim 0."""
        # A fresh handle per tensor: safetensors memory-maps the file, and the pages a read touches stay resident
        # (and counted in RSS) while a handle is open. Closing it after each tensor keeps reads streamed.
        try:
            with safe_open(str(self._file_of[name]), framework="pt") as handle:
                return handle.get_tensor(name) if expert is None else handle.get_slice(name)[expert]
        except (SafetensorError, OSError, ValueError) as err:
            raise AdapterError(f"cannot read tensor {name!r} from {self._file_of[name]} ({err}); the file may be corrupt") from err


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
