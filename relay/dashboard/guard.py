"""Who may act: the operator's token (a Bearer header, or the login form that marks the
browser's session), and a CSRF token per session checked on every form POST.

Sessions live in memory, one per browser (a random id in an HttpOnly, SameSite=Strict
cookie): a restarted dashboard asks to log in again.
"""

from __future__ import annotations

import hmac
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

COOKIE = "outbox_dashboard"
MAX_SESSIONS = 1000  # the oldest are forgotten past this (each a few bytes)


@dataclass
class Session:
    id: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    csrf: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    logged_in: bool = False


class Sessions:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.known: OrderedDict[str, Session] = OrderedDict()

    def get(self, session_id: str | None) -> Session | None:
        with self.lock:
            return self.known.get(session_id or "")

    def new(self) -> Session:
        session = Session()
        with self.lock:
            self.known[session.id] = session
            while len(self.known) > MAX_SESSIONS:
                self.known.popitem(last=False)
        return session

    def log_in(self, old: Session) -> Session:
        """A new session (new id and CSRF token) for the logged-in browser: an id
        planted before the login is worth nothing after it."""
        with self.lock:
            self.known.pop(old.id, None)
        session = self.new()
        session.logged_in = True
        return session


def same(given: str | None, expected: str | None) -> bool:
    """Constant-time equality of two secrets; an empty or missing one never matches."""
    if not given or not expected:
        return False
    return hmac.compare_digest(given.encode(), expected.encode())


def bearer(header: str | None) -> str | None:
    scheme, _, value = (header or "").partition(" ")
    return value.strip() if scheme.lower() == "bearer" else None
