"""`make demo`'s program, run as a user runs it: a subprocess on the embedded defaults."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def figure(output: str, name: str) -> str:
    match = re.search(rf"^\s+{re.escape(name)}\s+(\S+)\s*$", output, flags=re.M)
    assert match, f"{name!r} missing from the demo's table:\n{output}"
    return match.group(1)


def test_demo_prints_no_loss_no_phantom_and_each_message_handled_once() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("OUTBOX_DB", "OUTBOX_BROKER")}
    done = subprocess.run(
        [sys.executable, "-m", "examples.demo", "--requests", "400"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert figure(out, "lost (must be 0)") == "0"
    assert figure(out, "phantom (must be 0)") == "0"
    committed, rolled_back = int(figure(out, "committed")), int(figure(out, "rolled back"))
    assert committed + rolled_back == 400 and rolled_back > 0
    assert figure(out, "delivered") == str(committed)
    # The consumer's inbox: each message handled once, the replayed stream acked unhandled.
    assert figure(out, "consumer: handled once") == str(committed)
    assert figure(out, "consumer: handled twice (must be 0)") == "0"
    assert figure(out, "consumer: replayed, acked unhandled") == str(committed)
    assert "sqlite:///" in out, "the default database is an embedded SQLite file"
