"""One configuration surface: every Settings field as an Outbox keyword, an OUTBOX_<FIELD>
variable and a generated flag of `outbox relay` / `outbox drain`, checked by one function
with one error format; `--app module:attr` takes them from the app's own Outbox."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from outbox import Outbox
from outbox.errors import ConfigError
from outbox.settings import Settings, env_names, environment_of, flag_names, has_flag
from relay.cli import build_parser, command_settings, main
from relay.cli.app import use_app
from relay.cli.settings_flags import APP_ONLY

ALL = {f.name for f in dataclasses.fields(Settings)}


def parsed(*words: str) -> argparse.Namespace:
    return build_parser().parse_args(list(words))


def settings_of(*words: str) -> Settings:
    args = parsed(*words)
    return command_settings(args, use_app(args))


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for f in dataclasses.fields(Settings):
        for name in env_names(f):
            monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(
    ("variable", "text", "field", "value"),
    [
        ("OUTBOX_SWEEPER_AGE_S", "9", "sweeper_age_s", 9.0),
        ("OUTBOX_QUEUE_SIZE", " 64 ", "queue_size", 64),
        ("OUTBOX_RETRY_DELAYS_MS", "0,5,10", "retry_delays_ms", (0, 5, 10)),
        ("OUTBOX_VERIFY_COMMIT", "false", "verify_commit", False),
        ("OUTBOX_VERIFY_COMMIT", "0", "verify_commit", False),
        ("OUTBOX_VERIFY_COMMIT", "TRUE", "verify_commit", True),
        ("OUTBOX_MARK_MODE", "delete", "mark_mode", "delete"),
        ("OUTBOX_CONNECT_TIMEOUT", "2", "connect_timeout_s", 2.0),  # the older name
    ],
)
def test_each_field_is_read_from_its_variable(
    variable: str, text: str, field: str, value: object
) -> None:
    assert getattr(Settings.from_options({}, {variable: text}), field) == value


def test_every_field_round_trips_through_the_environment() -> None:
    changed = Settings(
        sweeper_age_s=3, handoff_limit_s=2.5, retry_delays_ms=(0, 7.5), verify_commit=False,
        mark_mode="delete", queue_size=5, connect_timeout_s=1.5,
    )  # fmt: skip
    variables = environment_of(changed)
    assert set(variables) == {env_names(f)[0] for f in dataclasses.fields(Settings)}
    assert Settings.from_options({}, variables) == changed


def test_precedence_keyword_then_environment_then_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_SWEEPER_AGE_S", "30")
    monkeypatch.setenv("OUTBOX_MAX_ATTEMPTS", "7")
    monkeypatch.setenv("OUTBOX_CONNECT_TIMEOUT", "9")
    monkeypatch.setenv("OUTBOX_CONNECT_TIMEOUT_S", "4")  # the field's own name wins
    ob = Outbox("sqlite://", max_attempts=3)
    try:
        s = ob.settings
        assert (s.sweeper_age_s, s.max_attempts, s.connect_timeout_s) == (30, 3, 4)
        assert s.backoff_cap_s == Settings().backoff_cap_s
    finally:
        ob.engine.dispose()


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"OUTBOX_SWEEPER_AGE_S": "ten"},
         "sweeper_age_s (OUTBOX_SWEEPER_AGE_S): must be a number above 0, at most 604800, "
         "got 'ten'"),
        ({"OUTBOX_QUEUE_SIZE": "0"},
         "queue_size (OUTBOX_QUEUE_SIZE): must be a whole number from 1 to 10000000, got 0"),
        ({"OUTBOX_VERIFY_COMMIT": "yes"},
         "verify_commit (OUTBOX_VERIFY_COMMIT): must be True or False"),
        ({"OUTBOX_MARK_MODE": "drop"},
         "mark_mode (OUTBOX_MARK_MODE): must be one of keep, delete"),
        ({"OUTBOX_RETRY_DELAYS_MS": "0,-5"},
         "retry_delays_ms (OUTBOX_RETRY_DELAYS_MS): must be 1 to 1000 delays, each 0 to 86400000"),
        ({"OUTBOX_SWEEPER_AGE_S": "5"},
         "handoff_limit_s (default): must be below sweeper_age_s (5 from OUTBOX_SWEEPER_AGE_S)"),
    ],
)  # fmt: skip
def test_a_bad_variable_fails_when_the_outbox_is_built(
    given: dict[str, str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, text in given.items():
        monkeypatch.setenv(name, text)
    with pytest.raises(ConfigError) as refused:
        Outbox("sqlite://")
    assert str(refused.value).startswith(message)


def test_a_keyword_error_has_the_same_format() -> None:
    with pytest.raises(
        ConfigError, match=r"^tick_ms \(keyword\): must be a number above 0, at most 60000, got -1$"
    ):
        Outbox("sqlite://", tick_ms=-1)
    with pytest.raises(ConfigError, match=r"^unknown option\(s\) sweeper_age; known: "):
        Outbox("sqlite://", sweeper_age=3)


def test_relay_help_lists_a_flag_per_field() -> None:
    relay_help = build_parser()._subparsers._group_actions[0].choices["relay"].format_help()  # type: ignore[union-attr]
    for f in dataclasses.fields(Settings):  # the fast path's fields: taken, not listed
        assert (flag_names(f)[0] in relay_help) == (has_flag(f) and f.name not in APP_ONLY), f.name
    assert "--start-relay" not in relay_help  # the app's switch, not a worker's
    assert "--interval" in relay_help and "--retention-days" in relay_help and "--app" in relay_help


@pytest.mark.parametrize("command", ["relay", "drain"])
def test_flags_win_over_the_environment(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_SWEEPER_AGE_S", "30")
    monkeypatch.setenv("OUTBOX_MAX_ATTEMPTS", "7")
    s = settings_of(command, "--sweeper-age-s", "12", "--retry-delays-ms", "0,1", "--mark-mode",
                    "delete", "--verify-commit", "false")  # fmt: skip
    assert (s.sweeper_age_s, s.max_attempts, s.retry_delays_ms) == (12, 7, (0, 1))
    assert (s.mark_mode, s.verify_commit) == ("delete", False)


def test_the_older_flags_still_work() -> None:
    s = settings_of("relay", "--interval", "0.2", "--retention-days", "2", "--connect-timeout", "3")
    assert (s.sweep_interval_s, s.retention_s, s.connect_timeout_s) == (0.2, 2 * 86400, 3)
    assert settings_of("relay") == Settings()


def test_other_commands_read_only_their_own_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_SWEEPER_AGE_S", "not read by status")
    monkeypatch.setenv("OUTBOX_CONNECT_TIMEOUT_S", "3")
    assert settings_of("status", "--db", "sqlite://").connect_timeout_s == 3


def test_a_bad_flag_or_variable_stops_the_command_at_start(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["--db", "sqlite://", "--broker", "nats://127.0.0.1:1"]
    assert main(["relay", *common, "--sweeper-age-s", "-3"]) == 2
    line = (
        "outbox relay: sweeper_age_s (--sweeper-age-s): must be a number above 0, at most "
        "604800, got -3.0"
    )
    assert capsys.readouterr().err.strip() == line
    monkeypatch.setenv("OUTBOX_HANDOFF_LIMIT_S", "20")
    assert main(["drain", *common]) == 2
    assert (
        "handoff_limit_s (OUTBOX_HANDOFF_LIMIT_S): must be below sweeper_age_s (10 from default)"
        in capsys.readouterr().err
    )


APP = """
from outbox import Outbox
ob = Outbox("sqlite:///{db}", broker="redis://127.0.0.1:1/0", sweeper_age_s=4,
            handoff_limit_s=3, max_attempts=5)
def make():
    return ob
not_an_outbox = 42
def in_memory():
    from relay.testing import MemoryBroker
    return Outbox("sqlite:///{db}", broker=MemoryBroker())
"""


@pytest.fixture
def app_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    name = f"outbox_app_{tmp_path.name}".replace("-", "_")
    (tmp_path / f"{name}.py").write_text(APP.format(db=tmp_path / "app.sqlite"))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    module = sys.modules.pop(name, None)
    if module is not None:
        module.ob.engine.dispose()


@pytest.mark.parametrize("attr", ["ob", "make"])
def test_app_gives_db_broker_and_settings(app_module: str, attr: str, tmp_path: Path) -> None:
    args = parsed("relay", "--app", f"{app_module}:{attr}", "--max-attempts", "9")
    s = command_settings(args, use_app(args))
    assert args.db == f"sqlite:///{tmp_path / 'app.sqlite'}"
    assert args.broker == "redis://127.0.0.1:1/0"
    assert (s.sweeper_age_s, s.handoff_limit_s, s.max_attempts) == (4, 3, 9)  # the flag wins


def test_app_comes_before_the_environment(app_module: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_DB", "sqlite:///elsewhere.sqlite")
    monkeypatch.setenv("OUTBOX_SWEEPER_AGE_S", "30")  # read by the app at import: 4 is its keyword
    args = parsed("drain", "--app", f"{app_module}:ob", "--broker", "nats://127.0.0.1:1")
    s = command_settings(args, use_app(args))
    assert args.db.endswith("app.sqlite") and args.broker == "nats://127.0.0.1:1"
    assert s.sweeper_age_s == 4


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module_here:ob", "--app: no module named 'no_such_module_here'"),
        ("{app}:missing", "--app: module '{app}' has no attribute 'missing'"),
        ("{app}:not_an_outbox", "--app: '{app}:not_an_outbox' is of type int, not an Outbox"),
        ("{app}", "--app: '{app}' must be MODULE:ATTR"),
        ("{app}:in_memory", "--app: the app's Outbox has a MemoryBroker object, not a broker URL"),
    ],
)
def test_a_bad_app_names_the_flag(
    spec: str, message: str, app_module: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["relay", "--app", spec.format(app=app_module)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("outbox relay: " + message.format(app=app_module)), err
