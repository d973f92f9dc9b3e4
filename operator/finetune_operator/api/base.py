"""Base model for the FinetuneJob API: camelCase on the wire, snake_case in Python."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class SpecModel(BaseModel):
    """Strict spec object: unknown fields are errors (a typo must not be silently ignored)."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        # YAML can say .inf and .nan; JSON (the API server) cannot, and no bound means anything with them.
        allow_inf_nan=False,
        use_enum_values=False,
    )

    def wire(self) -> dict:  # type: ignore[type-arg]
        """The object as it appears in YAML/JSON (camelCase, defaults included, nulls dropped)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class StatusModel(BaseModel):
    """Status objects are written by the operator; tolerate fields from newer operator versions."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="ignore",
    )

    def wire(self) -> dict:  # type: ignore[type-arg]
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)
