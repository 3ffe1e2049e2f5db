"""The table and the request body, SQLModel's way: one set of fields, two classes."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import field_validator
from sqlalchemy import Column, DateTime, func
from sqlmodel import Field, SQLModel

from examples.warehouse import DOCK_LENGTH, INT_MAX, SKU_LENGTH, TABLE, unstorable


class InboundBase(SQLModel):
    """What a client sends and the table stores, bounded to what the columns take."""

    sku: str = Field(min_length=1, max_length=SKU_LENGTH)
    quantity: int = Field(gt=0, le=INT_MAX)
    dock: str = Field(default="D1", min_length=1, max_length=DOCK_LENGTH)

    @field_validator("quantity", mode="before")
    @classmethod
    def whole_number(cls, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError("must be an integer")  # not "5", 1.0 or true
        return value

    @field_validator("sku", "dock")
    @classmethod
    def storable(cls, value: str) -> str:
        if rule := unstorable(value):
            raise ValueError(rule)
        return value


class Inbound(InboundBase, table=True):
    __tablename__ = TABLE

    id: int | None = Field(default=None, primary_key=True)
    received_at: datetime | None = Field(
        default=None,
        sa_column=Column(DateTime(timezone=True), server_default=func.now(), nullable=False),
    )


class InboundIn(InboundBase):
    """The request body: the row's fields and the message's tags."""

    tags: list[str] | None = None  # send() has the last word on them (400 naming the field)
