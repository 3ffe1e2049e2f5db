"""Modules that moved in the restructuring (issue 39) still import from their old paths,
with a DeprecationWarning naming the new one, for one release."""

import importlib
import subprocess
import sys

import pytest

import relay
from relay import MOVED, moved_to


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_gives_the_new_module_and_warns(old: str) -> None:
    new = MOVED[old]
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)


def test_a_moved_packages_modules_follow_it() -> None:
    assert moved_to("relay.halfop.link") == "relay.lab.halfop.link"
    assert moved_to("relay.halfoplink") is None
    assert moved_to("relay.runtime") is None
    sys.modules.pop("relay.halfop.link", None)
    with pytest.warns(DeprecationWarning):
        module = importlib.import_module("relay.halfop.link")
    assert module is importlib.import_module("relay.lab.halfop.link")


def test_from_relay_import_an_old_name() -> None:
    code = (
        "import warnings; warnings.simplefilter('error')\n"
        "try:\n    from relay import dispatcher\nexcept DeprecationWarning as w:\n    print(w)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "relay.dispatcher moved to relay.fastpath.dispatcher" in out.stdout


def test_paths_that_did_not_move_import_without_a_warning() -> None:
    code = (
        "import warnings; warnings.simplefilter('error')\n"
        "from relay import store, runtime, export, metrics\n"
        "from relay.fastpath import dispatcher\nimport relay.sweep.sweeper\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_unknown_module_is_still_missing() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("relay.no_such_module")
    assert relay.MovedFinder().find_spec("outbox.dispatcher", None) is None
