"""The table (SQLAlchemy's declarative mapping) and the request body (Pydantic)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import AfterValidator, BaseModel, Field, StrictInt
from sqlalchemy import DateTime, String, func
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from examples.warehouse import DOCK_LENGTH, INT_MAX, SKU_LENGTH, TABLE, unstorable


class Base(DeclarativeBase):
    pass


class Inbound(Base):
    __tablename__ = TABLE

    id: Mapped[int] = mapped_column(primary_key=True)
    sku: Mapped[str] = mapped_column(String(SKU_LENGTH))
    quantity: Mapped[int]
    dock: Mapped[str] = mapped_column(String(DOCK_LENGTH))
    received_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now()
    )


def storable(value: str) -> str:
    if rule := unstorable(value):
        raise ValueError(rule)
    return value


# What the columns take: 1 to the String's length, storable (examples.warehouse).
Sku = Annotated[str, Field(min_length=1, max_length=SKU_LENGTH), AfterValidator(storable)]
Dock = Annotated[str, Field(min_length=1, max_length=DOCK_LENGTH), AfterValidator(storable)]


class Delivery(BaseModel):
    sku: Sku
    quantity: StrictInt = Field(gt=0, le=INT_MAX)
    dock: Dock = "D1"
    tags: list[str] | None = None  # sent as the message's tags: send() has the last word
