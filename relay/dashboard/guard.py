"""Who may act: the operator's token (a Bearer header, or the login form that marks the
browser's session), and a CSRF token per session checked on every form POST.

Sessions live in memory (a random id in an HttpOnly, SameSite=Strict cookie): a restarted
dashboard asks to log in again. One is made only for a browser shown the login or a
confirm form, never for a request with the Bearer header: anonymous requests cannot
crowd a logged-in operator out (past MAX_SESSIONS the least recently used anonymous
session goes first), and a logged-in one left idle IDLE_S is forgotten.
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

COOKIE = "outbox_dashboard"
MAX_SESSIONS = 1000  # past this the least recently used are forgotten, anonymous ones first
IDLE_S = 30 * 60  # a logged-in session unused this long is logged out


@dataclass
class Session:
    id: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    csrf: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    logged_in: bool = False
    used: float = 0.0  # the clock's time of its last request


class Sessions:
    """The sessions, each kind in least recently used order."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.lock = threading.Lock()
        self.anonymous: OrderedDict[str, Session] = OrderedDict()
        self.logged_in: OrderedDict[str, Session] = OrderedDict()

    def get(self, session_id: str | None) -> Session | None:
        """The session (marked used now), None when unknown, forgotten or idle too long."""
        now = self.clock()
        with self.lock:
            for kind in (self.logged_in, self.anonymous):
                session = kind.get(session_id or "")
                if session is None:
                    continue
                if session.logged_in and now - session.used > IDLE_S:
                    del kind[session.id]
                    return None
                session.used = now
                kind.move_to_end(session.id)
                return session
        return None

    def new(self, logged_in: bool = False) -> Session:
        session = Session(logged_in=logged_in, used=self.clock())
        with self.lock:
            (self.logged_in if logged_in else self.anonymous)[session.id] = session
            while len(self.anonymous) + len(self.logged_in) > MAX_SESSIONS:
                (self.anonymous or self.logged_in).popitem(last=False)
        return session

    def log_in(self, old: Session) -> Session:
        """A new session (new id and CSRF token) for the logged-in browser: an id
        planted before the login is worth nothing after it."""
        self.drop(old)
        return self.new(logged_in=True)

    def drop(self, session: Session) -> None:
        with self.lock:
            self.anonymous.pop(session.id, None)
            self.logged_in.pop(session.id, None)

    def __len__(self) -> int:
        return len(self.anonymous) + len(self.logged_in)


def same(given: str | None, expected: str | None) -> bool:
    """Constant-time equality of two secrets; an empty or missing one never matches."""
    if not given or not expected:
        return False
    return hmac.compare_digest(given.encode(), expected.encode())


def bearer(header: str | None) -> str | None:
    scheme, _, value = (header or "").partition(" ")
    return value.strip() if scheme.lower() == "bearer" else None
