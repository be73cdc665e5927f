"""The schema's base model: every section is a pydantic model that rejects keys it does not know."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")
