"""The base of every spec section: frozen, no unknown keys; and the path check they share."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict
from pydantic_core import PydanticCustomError

# torch's names of the 16/32-bit float types (HF configs' `torch_dtype: bfloat16`), accepted for dsmt's short ones
DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def _short_dtype(value):
    return DTYPE_ALIASES.get(value.lower(), value) if isinstance(value, str) else value


# a float type as the spec holds it once validated: always the short name
FloatType = Annotated[Literal["bf16", "fp16", "fp32"], BeforeValidator(_short_dtype)]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _safe_path(value: str | None, *, what: str) -> str | None:
    if value is not None and (not value or any(ch in value for ch in "\n\r\0")):
        raise PydanticCustomError("bad_path", "{what} must be a non-empty single-line path", {"what": what})
    return value
