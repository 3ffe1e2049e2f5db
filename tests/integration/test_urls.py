"""Database URLs as hosting platforms write them (postgres://, mysql://, mariadb://) reach
the real servers through the drivers outbox-relay installs, and errors keep the scheme."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from outbox import Outbox, migrate
from outbox.errors import ConfigError
from outbox.secrets import mask_url, scrub
from outbox.urls import with_driver
from tests.helpers import unsent

OUTBOX = str(Path(sys.executable).with_name("outbox"))


def bare(url: str, scheme: str) -> str:
    """``url`` with its dialect+driver replaced by a bare ``scheme``."""
    return f"{scheme}://{url.partition('://')[2]}"


@pytest.mark.parametrize(
    ("given", "driver"),
    [
        ("postgres://u@h/db", "postgresql+psycopg"),
        ("postgresql://u@h/db", "postgresql+psycopg"),
        ("mysql://u@h/db", "mysql+pymysql"),
        ("mariadb://u@h/db", "mariadb+pymysql"),
        ("postgresql+asyncpg://u@h/db", "postgresql+asyncpg"),  # a named driver stays
        ("sqlite:///x.db", "sqlite"),
    ],
)
def test_bare_schemes_get_the_installed_driver(given: str, driver: str) -> None:
    assert with_driver(given).drivername == driver


def sent_once(url: str) -> tuple[str, int]:
    """Send one message through an Outbox on ``url``: its engine's driver, and how many
    rows the table holds afterwards."""
    ob = Outbox(url)
    try:
        migrate.upgrade(ob.engine)
        with Session(ob.engine) as session, session.begin():
            ob.send(session, "urls.x", b"x")
        with ob.engine.connect() as conn:
            rows = conn.execute(text("SELECT COUNT(*) FROM outbox_message")).scalar_one()
    finally:
        ob.stop()
    return ob.engine.url.drivername, rows


@pytest.mark.parametrize("scheme", ["postgres", "postgresql"])
def test_postgres_urls_send_through_psycopg(pg_url: str, scheme: str) -> None:
    assert sent_once(bare(pg_url, scheme)) == ("postgresql+psycopg", 1)
    assert unsent(pg_url) == 1


@pytest.mark.parametrize("scheme", ["mysql", "mariadb"])
def test_mysql_urls_send_through_pymysql(mariadb_url: str, scheme: str) -> None:
    driver, rows = sent_once(bare(mariadb_url, scheme))
    assert rows == 1
    assert driver.partition("+")[2] == "pymysql"


def test_the_cli_takes_postgres_urls(pg_url: str) -> None:
    db = bare(pg_url, "postgres")
    done = subprocess.run([OUTBOX, "migrate", "--db", db], capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    status = subprocess.run([OUTBOX, "status", "--db", db], capture_output=True, text=True,
                            timeout=120, check=False)  # fmt: skip
    assert status.returncode == 0 and "TOTAL" in status.stdout, status.stderr


def test_an_unknown_scheme_is_named_with_the_cure() -> None:
    url = "postgress://postgres@127.0.0.1/x"  # a typo; the user name looks like the scheme
    with pytest.raises(ConfigError) as caught:
        Outbox(url)
    line = scrub(str(caught.value), [url])
    assert "'postgress://" in line and "postgresql://" in line, line
    done = subprocess.run([OUTBOX, "status", "--db", url], capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip
    assert done.returncode == 2, done.stderr  # a bad value: usage
    assert "cannot use 'postgress://" in done.stderr and "Traceback" not in done.stderr


def test_the_scheme_is_never_masked() -> None:
    assert mask_url("postgres://postgres@h/x") == "postgres://postgres@h/x"
    assert mask_url("postgres://u:s3cret@h/x") == "postgres://u:***@h/x"
    assert scrub("nats://nats@h down", ["nats://nats@h"]) == "nats://***@h down"  # token = scheme
    assert scrub("token tok3n at nats://tok3n@h", ["nats://tok3n@h"]) == "token *** at nats://***@h"
