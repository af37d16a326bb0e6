"""The base of every spec section: frozen, no unknown keys; and the path check they share."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic_core import PydanticCustomError


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _safe_path(value: str | None, *, what: str) -> str | None:
    if value is not None and (not value or any(ch in value for ch in "\n\r\0")):
        raise PydanticCustomError("bad_path", "{what} must be a non-empty single-line path", {"what": what})
    return value
