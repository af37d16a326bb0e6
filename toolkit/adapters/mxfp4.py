"""MXFP4 weights as GPT-OSS publishes them (`quantization_config.quant_method: mxfp4`), read as bf16.

Layout (transformers' integrations/mxfp4.py, `convert_moe_packed_tensors`, which this reproduces bit for bit): an
expert weight `X` is stored as two uint8 tensors
    X_blocks  [E, rows, G, 16]  32 FP4 (e2m1) codes per block, two per byte: the low nibble is the even value,
                                the high nibble the odd one; code -> value by `FP4_E2M1_VALUES`;
    X_scales  [E, rows, G]      one e8m0 exponent per block of 32, biased by 127: value x 2^(scale - 127);
with rows the output features ([out, in], as torch.nn.Linear), G x 32 the input features. transformers' GPT-OSS
parameter is the transpose, [E, in, out] (`experts.gate_up_proj` [E, hidden, 2I], `experts.down_proj`
[E, I, hidden]), in bf16. `SafetensorsSource(dequantize_mxfp4=True)` presents each pair under the name `X` with that
shape and dtype, and reads one expert at a time (`dequantize_expert`)."""

from __future__ import annotations

import dataclasses

import torch

FP4_E2M1_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127  # e8m0: 2 ** (scale - 127)
BYTES_PER_BLOCK = 16  # 32 four-bit codes
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
DEQUANTIZED_DTYPE = torch.bfloat16  # what transformers dequantises GPT-OSS's experts into (its dtype)


def dequantize_rows(blocks: torch.Tensor, scales: torch.Tensor, *, dtype: torch.dtype = DEQUANTIZED_DTYPE
                    ) -> torch.Tensor:
    """[..., rows, G, 16] codes and [..., rows, G] exponents -> [..., rows, G x 32] values, as stored ([out, in]).
    The same operations as transformers': codes looked up in `dtype`, then `torch.ldexp` by the unbiased exponent."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BYTES_PER_BLOCK:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}: expected "
                         f"[..., G, {BYTES_PER_BLOCK}] and [..., G]")
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=dtype)
    codes = blocks.to(torch.uint8)
    values = torch.empty((*codes.shape[:-1], 2 * BYTES_PER_BLOCK), dtype=dtype)
    values[..., 0::2] = lut[(codes & 0x0F).to(torch.int)]
    values[..., 1::2] = lut[(codes >> 4).to(torch.int)]
    torch.ldexp(values, (scales.to(torch.int32) - SCALE_BIAS).unsqueeze(-1), out=values)
    return values.reshape(*codes.shape[:-2], -1)


def dequantize_experts(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Every expert: [E, rows, G, 16] + [E, rows, G] -> transformers' parameter [E, G x 32, rows]."""
    return dequantize_rows(blocks, scales).transpose(1, 2).contiguous()


def dequantize_expert(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One expert's slice: [rows, G, 16] + [rows, G] -> [G x 32, rows] (slice e of `dequantize_experts`)."""
    return dequantize_rows(blocks, scales).t().contiguous()


def parameter_shape(blocks_shape: tuple[int, ...]) -> tuple[int, int, int]:
    """transformers' parameter shape [E, G x 32, rows] of blocks [E, rows, G, 16]."""
    experts, rows, groups, _ = blocks_shape
    return experts, groups * 2 * BYTES_PER_BLOCK, rows


@dataclasses.dataclass(frozen=True)
class Mxfp4Weight:
    """A stored MXFP4 expert weight the source presents dequantised: its two tensors."""

    blocks_name: str
    scales_name: str


def pair_mxfp4(entries: dict[str, tuple[tuple[int, ...], torch.dtype | None]]
               ) -> tuple[dict[str, Mxfp4Weight], list[str]]:
    """(presented name -> its MXFP4 tensors, problems) over a checkpoint's tensors (name -> (shape, dtype)): every
    `X_blocks` needs its `X_scales` and the reverse, both uint8, blocks [E, rows, G, 16] over scales [E, rows, G]."""
    pairs, problems = {}, []
    for name in sorted(entries):
        if name.endswith(SCALES_SUFFIX) and name.removesuffix(SCALES_SUFFIX) + BLOCKS_SUFFIX not in entries:
            problems.append(f"{name} scales no {name.removesuffix(SCALES_SUFFIX) + BLOCKS_SUFFIX}")
        if not name.endswith(BLOCKS_SUFFIX):
            continue
        weight = name.removesuffix(BLOCKS_SUFFIX)
        scales = weight + SCALES_SUFFIX
        (shape, dtype), (scale_shape, scale_dtype) = entries[name], entries.get(scales, ((), None))
        if scales not in entries:
            problems.append(f"MXFP4 blocks {name} {list(shape)} have no {scales}")
        elif (dtype, scale_dtype) != (torch.uint8, torch.uint8) or len(shape) != 4 \
                or shape[-1] != BYTES_PER_BLOCK or tuple(shape[:-1]) != tuple(scale_shape):
            problems.append(f"{name} {list(shape)} {dtype} with {scales} {list(scale_shape)} {scale_dtype}: expected "
                            f"uint8 [experts, rows, G, {BYTES_PER_BLOCK}] and uint8 [experts, rows, G]")
        elif weight in entries:
            problems.append(f"{weight} is stored both plain and as MXFP4 ({name})")
        else:
            pairs[weight] = Mxfp4Weight(blocks_name=name, scales_name=scales)
    return pairs, problems
