"""The app's one model: a delivery received at a dock."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import DateTime, String, func
from sqlalchemy.orm import Mapped, mapped_column

from examples.warehouse import DOCK_LENGTH, SKU_LENGTH, TABLE
from examples.webapp.extensions import db


class Inbound(db.Model):
    __tablename__ = TABLE

    id: Mapped[int] = mapped_column(primary_key=True)
    sku: Mapped[str] = mapped_column(String(SKU_LENGTH))
    quantity: Mapped[int]
    dock: Mapped[str] = mapped_column(String(DOCK_LENGTH))
    received_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now()
    )
