"""The operator's side of the consumers' inboxes: `outbox dead --consumer NAME` lists a
consumer's dead letters (exit 3 when there are), `outbox requeue --consumer NAME` gives
them back for its runner, and `outbox consume` explains a bad --app."""

from __future__ import annotations

import json

import pytest

from outbox.inbox import Inbox, InboxMessage, Outcome
from outbox.message import uuid7
from relay import cli as cli_module
from tests.helpers import migrated


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = cli_module.main(list(argv))
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def test_a_consumers_dead_letters_are_listed_and_requeued(
    any_db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with migrated(any_db) as engine:
        inbox = Inbox(engine, "billing", max_attempts=1)
        inbox.handler("orders.*")(lambda session, message: 1 / 0)
        poison = InboxMessage.from_broker(str(uuid7()), "orders.created", b"{}", {})
        assert inbox.handle(poison).outcome is Outcome.DEAD

        code, out, _ = run(capsys, "dead", "--db", any_db, "--consumer", "billing")
        assert code == 3
        assert str(poison.msg_id) in out and "ZeroDivisionError: division by zero" in out
        code, out, _ = run(capsys, "dead", "--db", any_db, "--consumer", "other", "--json")
        assert (code, json.loads(out)["messages"]) == (0, [])

        code, out, _ = run(capsys, "requeue", "--db", any_db, "--consumer", "billing", "--dead")
        assert (code, out.strip()) == (0, "requeued 1 dead letter(s) of consumer billing")
        assert inbox.requeued() == [poison]
        code, out, _ = run(capsys, "dead", "--db", any_db, "--consumer", "billing")
        assert (code, out.strip()) == (0, "no dead letters of consumer billing")


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ("tests", "must be MODULE:ATTR"),
        ("tests.consume_app:nothing", "has no attribute 'nothing'"),
        ("tests.consume_app:invoice", "is of type Table, not an Inbox"),
    ],
)
def test_consume_explains_a_bad_app(
    spec: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, "consume", "--app", spec, "--broker", "nats://127.0.0.1:1")
    assert code == 2 and said in err
