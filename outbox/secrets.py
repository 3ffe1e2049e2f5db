"""Secrets in URLs: masking them for output, and scrubbing them from text written by others.

Passwords and tokens never reach a log line, an error, ``repr(Outbox)``, the CLI's
output or a report (docs/configuration.md, "Secrets in URLs").
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from urllib.parse import unquote

from sqlalchemy import Engine
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError

from outbox.broker import BROKER_SCHEMES
from outbox.urls import with_driver

# A match inside a URL's scheme is spared: the scheme says what went wrong, and a password
# such as "postgres" in postgresql://postgres:postgres@db must still go everywhere else.
IN_SCHEME = r"(?![A-Za-z0-9+.\-]*://)"
MIN_SCRUBBED = 3  # shorter "secrets" would garble every message they are scrubbed from
RESERVED = re.compile(r"[:/?#\[\]@!$&'()*+,;=%\s]+")  # URL delimiters, and space
USER_SCHEMES = ("amqp", "amqps", "redis", "rediss")  # userinfo: a user name, then a password
# password=, sslpassword=, token=, auth_token=, secret=, ...: masked wherever they appear.
SECRET_PARAM = re.compile(r"([?&;][^=&#]*(?:pass|pwd|token|secret)[^=&#]*=)([^&#]*)", re.I)


def url_of(engine: Engine) -> str:
    """The engine's URL for output: password and password-like query parameters masked."""
    return mask_url(engine.url.render_as_string(hide_password=True))


def mask_url(url: object) -> str:
    """The URL without its secrets, fit for logs, errors and reports.

    Database URLs go through SQLAlchemy's own parser. Anything else (broker URLs, and
    what SQLAlchemy cannot split unambiguously) loses its whole userinfo but an
    AMQP/Redis user name: urlsplit, which the broker clients use, stops at a raw '/',
    '?' or '#' in a password and would print the rest, and a NATS userinfo may be a
    token. Secret query parameters (``password``, ``token``, ...) are masked either way.
    """
    text = str(url)
    masked = _mask_db_url(text)
    return _mask_query(masked if masked is not None else _mask_userinfo(text))


def _mask_db_url(url: str) -> str | None:
    if url.count("@") > 1:  # a raw '@' in the password: SQLAlchemy would split it there
        return None
    if url.partition("://")[0] in BROKER_SCHEMES:  # spares the dialect lookup (milliseconds)
        return None
    try:
        parsed = make_url(url)  # rendered with its scheme as written
        with_driver(parsed).get_dialect()  # a database URL, not a broker's that happens to parse
    except (ArgumentError, NoSuchModuleError, ValueError, ImportError):
        return None
    return parsed.render_as_string(hide_password=True)


def _mask_userinfo(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")  # the last '@': the host cannot hold one
    if not sep or not at:
        return url
    user, colon, _ = userinfo.partition(":")
    if not colon and scheme in USER_SCHEMES:
        return url  # a user name alone
    kept = f"{user}:***" if colon and scheme in USER_SCHEMES else "***"
    return f"{scheme}://{kept}@{host}"


def _mask_query(url: str) -> str:
    return SECRET_PARAM.sub(r"\1***", url)


def secrets_of(url: str) -> list[str]:
    """The secrets a URL holds, as written and percent-decoded, for scrubbing free text."""
    scheme, _, rest = url.partition("://")
    user, colon, password = rest.rpartition("@")[0].partition(":")
    named = scheme in USER_SCHEMES or _mask_db_url(url) is not None  # a user, not a token
    found = [password if colon else "" if named else user]
    found += [m.group(2) for m in SECRET_PARAM.finditer(url)]
    found += [unquote(s) for s in found]
    # A driver that mis-parses a raw password echoes a piece of it (as a host name, say).
    found += [piece for s in found for piece in RESERVED.split(s)]
    kept = {s for s in found if len(s) >= MIN_SCRUBBED}
    return sorted(kept, key=len, reverse=True)


def scrub(text: str, urls: Iterable[str | None]) -> str:
    """``text`` with every secret of ``urls`` replaced, for messages written by others."""
    for url in urls:
        for secret in secrets_of(url) if url else ():
            text = re.sub(re.escape(secret) + IN_SCHEME, "***", text)
    return text
