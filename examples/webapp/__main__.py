"""``python -m examples.webapp --port 8000``, on OUTBOX_DB and OUTBOX_BROKER."""

try:
    from examples.webapp.app import main
except ModuleNotFoundError as exc:
    if exc.name not in ("flask", "flask_sqlalchemy", "flask_migrate"):
        raise
    raise SystemExit(
        f"examples.webapp needs {exc.name}: pip install -e '.[examples]' (in the checkout)"
    ) from None

main()
