"""Exceptions raised by the outbox.

Everything the library raises on purpose is an :class:`OutboxError`. Input errors
carry the offending ``field`` and the ``rule`` it broke, and are raised by
``Outbox.send()`` before any SQL runs, so the caller's transaction stays usable.
"""

from __future__ import annotations


class OutboxError(Exception):
    """Base class of every error the outbox raises on purpose."""


class ConfigError(OutboxError, ValueError):
    """A constructor argument, URL or CLI flag is not acceptable."""


class InvalidMessage(OutboxError, ValueError):
    """A message given to ``send()`` breaks a rule; nothing was written."""

    def __init__(self, field: str, rule: str) -> None:
        self.field = field
        self.rule = rule
        super().__init__(f"{field}: {rule}")


class InvalidTopic(InvalidMessage):
    """The topic is empty, not a valid subject for every broker, or one a broker reserves."""


class InvalidPayload(InvalidMessage):
    """The payload cannot be serialised to bytes."""


class PayloadTooLarge(InvalidMessage):
    """The payload with every header, as encoded for the broker, is above
    ``max_payload_bytes`` (at ``send()``), or above the broker's own limit (model B's half
    send, which is refused)."""


class InvalidHeaders(InvalidMessage):
    """A header name or value is not acceptable, or the headers are too large in all."""


class InvalidKey(InvalidMessage):
    """The ordering key is not an acceptable string."""


class InvalidTags(InvalidMessage):
    """A tag is not an acceptable string."""


class InvalidSchedule(InvalidMessage):
    """A ``delay``, ``deliver_at``, ``delay_level`` or ``dedup_key`` is not acceptable, or
    they are combined in a way that is refused (two times, or a schedule with ``ordered``)."""


class WrongDatabase(OutboxError):
    """The session passed to ``send()`` is bound to another database than the outbox's."""


class NotTransactional(ConfigError):
    """``send()`` was given a session whose connection commits each statement at once
    (``AUTOCOMMIT``): its row would be published whether or not the work around it
    commits. Nothing was written."""


class SchemaMissing(OutboxError):
    """The outbox's tables are not in the database ``send()`` writes to: run
    ``outbox migrate``. The driver's error is the ``__cause__``."""


class InvalidMsgId(ConfigError):
    """A msg_id an operator gave (a command's argument, a dashboard's parameter) is not
    a UUID; ``field`` names where it was given."""

    rule = "a msg_id (a UUID)"

    def __init__(self, field: str, given: str) -> None:
        self.field = field
        self.given = given
        self.said = f"not {self.rule}: {given!r}"
        super().__init__(f"{field}: {self.said}")


class UnknownMessage(OutboxError, LookupError):
    """No row has the msg_id an operator named: a typo, or a message purged by retention."""

    def __init__(self, field: str, msg_ids: list[str]) -> None:
        self.field = field
        self.msg_ids = msg_ids
        super().__init__(
            f"{field}: no message {', '.join(msg_ids)} (a typo, or purged by retention)"
        )
