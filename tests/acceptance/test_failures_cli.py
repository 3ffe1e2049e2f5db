"""What failed and why, from the command line: drain's reasons, `outbox dead`, `outbox show`.

Real processes against PostgreSQL and MariaDB, nats-server for the broker's refusals.
"""

from __future__ import annotations

import base64
import json
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

from sqlalchemy import create_engine, func, select, update
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from outbox import Outbox, migrate, outbox_message
from relay.testing.embedded import NatsServer
from tests.helpers import wait_until

t = outbox_message
OUTBOX = str(Path(sys.executable).with_name("outbox"))
BIG = b"x" * (1024 * 1024)  # with its headers, over nats-server's 1 MiB max_payload


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([OUTBOX, *args], capture_output=True, text=True, timeout=120, check=False)


def commit(db: str, topic: str, payloads: list[bytes] | list[str], **extra: object) -> list[str]:
    """Messages committed as an app that raised its size limit commits them."""
    migrate.upgrade(db)
    engine = create_engine(db, poolclass=NullPool)
    ob = Outbox(engine, max_payload_bytes=2 * 1024 * 1024)
    with Session(engine) as session, session.begin():
        ids = [ob.send(session, topic, p, **extra) for p in payloads]  # type: ignore[arg-type]
    engine.dispose()
    return ids


def test_drain_groups_its_failures_by_reason(
    pg_url: str, nats_server: NatsServer, stream: tuple[str, str]
) -> None:
    name, prefix = stream
    commit(pg_url, f"{prefix}.ok", [b"{}"] * 3)
    commit(pg_url, f"{prefix}.big", [BIG] * 5)
    commit(pg_url, "elsewhere.x", [b"{}"] * 2)  # no stream captures it: refused for good
    broker = f"{nats_server.url}?stream={name}&subjects={prefix}.>"
    done = cli("drain", "--db", pg_url, "--broker", broker)
    assert done.returncode == 3, done.stderr  # some went dead: the data needs a person
    lines = done.stdout.splitlines()
    assert lines[0].startswith("drained: sent=3 retry_later=0 dead=7 of 10 pending"), lines
    assert re.fullmatch(r"  5 x permanent: .*MaxPayload.* \(dead\)", lines[1]), lines
    refused = r"  2 x permanent: no JetStream stream captures .* \(dead\)"
    assert re.fullmatch(refused, lines[2]), lines
    assert len(lines) == 3, lines
    commit(pg_url, f"{prefix}.big", [BIG])
    as_json = json.loads(cli("drain", "--db", pg_url, "--broker", broker, "--json").stdout)
    [failure] = as_json["failures"]
    assert (failure["count"], failure["fate"]) == (1, "dead")
    assert failure["reason"] == lines[1].split(" x ", 1)[1].removesuffix(" (dead)")


def mark(db: str, msg_ids: list[str], **values: object) -> None:
    engine = create_engine(db, poolclass=NullPool)
    with engine.begin() as conn:
        conn.execute(
            update(t).where(t.c.msg_id.in_([uuid.UUID(m) for m in msg_ids])).values(**values)
        )
    engine.dispose()


def failures_planted(db: str) -> tuple[list[str], list[str]]:
    """3 dead and 2 failing messages among healthy ones; (dead, failing), oldest first."""
    commit(db, "ok.x", [b"{}"])  # pending, never tried: not a failure
    dead = commit(db, "bad.big", [b"{}"] * 3)
    failing = commit(db, "bad.flaky", [b"{}"] * 2)
    mark(db, commit(db, "ok.x", [b"{}"]), status="sent")
    mark(db, dead, status="dead", attempts=3, last_error="permanent: too large\nsecond line")
    mark(db, failing, attempts=2, last_error="retry: nacked \x1b[31mred")
    return dead, failing


def test_dead_lists_dead_and_failing_newest_first_a_page_at_a_time(any_db: str) -> None:
    dead, failing = failures_planted(any_db)
    done = cli("dead", "--db", any_db, "--json")
    assert done.returncode == 3, done.stderr  # dead messages listed, as `outbox status`
    report = json.loads(done.stdout)
    listed = report["messages"]
    assert [m["msg_id"] for m in listed] == [*reversed(failing), *reversed(dead)]
    assert report["next_before"] is None
    assert set(listed[0]) == {"msg_id", "status", "topic", "key", "seq", "blocks_behind",
                              "attempts", "created_at", "age_s", "next_attempt_at",
                              "last_error"}  # fmt: skip
    assert (listed[0]["status"], listed[0]["attempts"], listed[0]["topic"]) == (
        "failing",
        2,
        "bad.flaky",
    )
    assert (listed[-1]["status"], listed[-1]["last_error"]) == (
        "dead",
        "permanent: too large\nsecond line",
    )
    assert all(m["age_s"] >= 0 for m in listed)

    pages, before = [], []
    while True:
        page = json.loads(cli("dead", "--db", any_db, "--json", "--limit", "2", *before).stdout)
        pages.append([m["msg_id"] for m in page["messages"]])
        if page["next_before"] is None:
            break
        before = ["--before", page["next_before"]]
    assert [m for p in pages for m in p] == [m["msg_id"] for m in listed]
    assert [len(p) for p in pages] == [2, 2, 1]

    only_dead = json.loads(cli("dead", "--db", any_db, "--json", "--status", "dead").stdout)
    assert [m["msg_id"] for m in only_dead["messages"]] == list(reversed(dead))
    only_failing = cli("dead", "--db", any_db, "--json", "--status", "failing")
    assert only_failing.returncode == 0, only_failing.stderr  # failing, none dead yet
    assert [m["msg_id"] for m in json.loads(only_failing.stdout)["messages"]] == failing[::-1]


def test_dead_prints_a_table_with_one_line_errors(any_db: str) -> None:
    dead, failing = failures_planted(any_db)
    done = cli("dead", "--db", any_db, "--limit", "4")
    assert done.returncode == 3, done.stderr
    header, *rows, more = done.stdout.splitlines()
    assert header.split() == ["msg_id", "status", "topic", "key", "seq", "attempts", "age",
                              "last_error"]  # fmt: skip
    assert rows[0].startswith(failing[-1]) and "retry: nacked \\x1b[31mred" in rows[0]
    assert "\x1b" not in done.stdout, "a control character reached the terminal"
    assert rows[-1].startswith(dead[1]) and rows[-1].endswith("permanent: too large second line")
    assert more == f"more: --before {dead[1]}"
    assert cli("dead", "--db", any_db, "--status", "dead", "--topic", "ok.x").stdout == (
        "no dead or failing messages\n"
    )


def test_show_prints_one_message_and_an_unknown_id_is_an_error(any_db: str) -> None:
    text = "héllo wörld " * 200
    [msg] = commit(any_db, "bad.big", [text], key="k1", tags=["a", "b"], headers={"trace": "t1"})
    [binary] = commit(any_db, "bad.bin", [b"\x00\xff\x1b[2J"])
    mark(any_db, [msg], status="dead", attempts=3, last_error="permanent: too large")
    done = cli("show", "--db", any_db, msg, "--bytes", "9")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for expected in (f"msg_id:          {msg}", "status:          dead", "topic:           bad.big",
                     "key:             k1", "tags:            a,b", "attempts:        3",
                     "last_error:      permanent: too large", "sent_at:         -",
                     "  trace: t1"):  # fmt: skip
        assert expected in lines, (expected, lines)
    size = len(("héllo wörld " * 200).encode())
    at = lines.index(f"payload: {size} bytes, the first 9 shown")
    assert lines[at + 1] == "héllo w", "cut inside 'ö': the whole characters before it"
    assert lines[-1].startswith("history: the table keeps the latest attempt only")

    full = json.loads(cli("show", "--db", any_db, msg, "--full", "--json").stdout)
    assert (full["payload_preview"], full["payload_cut"]) == ("héllo wörld " * 200, False)
    assert (full["status"], full["headers"]["trace"], full["payload_bytes"]) == ("dead", "t1", size)

    raw = cli("show", "--db", any_db, binary)
    assert "b'\\x00\\xff\\x1b[2J'" in raw.stdout.splitlines() and "\x1b" not in raw.stdout
    as_json = json.loads(cli("show", "--db", any_db, binary, "--json").stdout)
    assert as_json["payload_encoding"] == "base64"
    assert base64.b64decode(as_json["payload_preview"]) == b"\x00\xff\x1b[2J"

    unknown = str(uuid.uuid4())
    for command in (["show", unknown], ["dead", "--before", unknown]):
        missing = cli(*command, "--db", any_db)
        assert missing.returncode == 2, missing  # bad usage, as `requeue --id`
        flag = "MSG_ID" if command[0] == "show" else "--before"
        assert missing.stderr == (
            f"outbox {command[0]}: {flag}: no message {unknown} (a typo, or purged by retention)\n"
        )


def test_dead_and_show_explain_themselves() -> None:
    for command in ("dead", "show"):
        done = cli(command, "--help")
        assert done.returncode == 0 and "--db" in done.stdout and "--json" in done.stdout


def test_relay_worker_logs_its_failures_by_reason_when_stopped(
    pg_url: str, nats_server: NatsServer, stream: tuple[str, str], tmp_path: Path
) -> None:
    name, prefix = stream
    commit(pg_url, f"{prefix}.ok", [b"{}"] * 3)
    big = commit(pg_url, f"{prefix}.big", [BIG] * 2)
    broker = f"{nats_server.url}?stream={name}&subjects={prefix}.>"
    quick = ["--sweeper-age-s", "0.2", "--handoff-limit-s", "0.1", "--sweep-interval-s", "0.1",
             "--backoff-base-s", "0.01", "--backoff-cap-s", "0.02"]  # fmt: skip
    err = (tmp_path / "stderr").open("w+")
    worker = subprocess.Popen([OUTBOX, "relay", "--db", pg_url, "--broker", broker, *quick],
                              stdout=subprocess.DEVNULL, stderr=err)  # fmt: skip
    try:
        engine = create_engine(pg_url, poolclass=NullPool)
        dead_ones = select(func.count()).where(t.c.status == "dead")

        def all_dead() -> bool:
            with engine.connect() as conn:
                return bool(conn.execute(dead_ones).scalar_one() == len(big))

        wait_until(all_dead, 60, "the oversized rows dead after permanent_attempts")
        engine.dispose()
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(60)
    err.seek(0)
    lines = err.read().splitlines()
    assert worker.returncode == 0, lines[-20:]
    [stopped] = [i for i, line in enumerate(lines) if "relay worker stopped by SIGTERM" in line]
    assert "sent=3 retry_later=4 dead=2" in lines[stopped], lines[stopped]
    reasons = [line.partition("relay.cli: ")[2] for line in lines[stopped + 1 :]]
    error = "permanent: MaxPayloadError: 1048639 bytes > server max_payload 1048576"
    assert reasons == [f"  4 x {error} (retry later)", f"  2 x {error} (dead)"], lines[stopped:]
