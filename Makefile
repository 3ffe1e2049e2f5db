# The README's commands: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev
DEMO_STAMP := $(VENV)/.installed-demo
DOCS_STAMP := $(VENV)/.installed-docs
SERVICES := postgres mariadb rabbitmq redis
JDBC_JAR := /usr/share/java/postgresql.jar
PROMTOOL := /usr/bin/promtool
CHROMIUM := /usr/bin/chromium

.PHONY: demo test lint typecheck imports check services bench bench-peers clean docs

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

services: $(JDBC_JAR) $(PROMTOOL) $(CHROMIUM)
	scripts/services.sh $(SERVICES)

# promtool, to check examples/relay_worker/alerts.yml (Debian's prometheus package; its
# daemon is not started).
$(PROMTOOL):
	apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus

# The PostgreSQL JDBC driver for Spark's partitioned ledger reads (Debian's package).
$(JDBC_JAR):
	apt-get update -qq && apt-get install -y -qq libpostgresql-jdbc-java

# Debian's chromium, driven headless by Playwright in the browser tests (tests/browser.py):
# `playwright install` would download a browser build this machine cannot fetch.
$(CHROMIUM):
	apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium

# Two xdist workers (the tests wait on brokers and subprocesses as much as they compute);
# the Spark tests share one of them (tests/conftest.py).
test: $(STAMP) services
	$(PY) -m pytest -n 2 --dist loadgroup $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# The layers (pyproject's [tool.importlinter]): outbox never imports relay but for
# Outbox.start(); spark_jobs imports neither. Then no import cycle between any two
# modules. Both count the imports under TYPE_CHECKING and inside functions.
imports: $(STAMP)
	$(VENV)/bin/lint-imports
	$(PY) scripts/import_cycles.py

check: lint typecheck imports

# Only what the demo needs (the `demo` extra): the test, check and bench targets add the rest.
$(DEMO_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[demo]'
	touch $@

demo: $(DEMO_STAMP)
	$(PY) -m examples.demo

# The documentation site (mkdocs.yml) into site/, strict: a broken link or anchor, a missing
# API reference fails it. Only the `docs` extra (the CLI reference imports the package).
# NO_MKDOCS_2_WARNING: Material's notice about MkDocs 2.0, a dozen lines on every build.
$(DOCS_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[docs]'
	touch $@

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

clean:
	rm -rf $(VENV) build dist site *.egg-info .pytest_cache .mypy_cache .ruff_cache

bench: $(STAMP) services
	$(PY) -m pip install --quiet -e '.[dev,bench]'
	$(PY) -m bench.fast_path $(BENCH_ARGS)
	$(PY) -m bench.sweeper
	$(PY) -m bench.halfop
	$(PY) -m bench.poison
	$(PY) -m bench.reconcile
	$(PY) -m bench.async_app
	$(PY) -m bench.outage

# The peer comparison (bench/peers.py): faststream-outbox, nats-outbox and this project,
# one after the other. PEERS_ARGS, e.g. `--seconds 5 --rows 5000` or `--only nats-outbox`.
bench-peers: $(STAMP) services
	$(PY) -m pip install --quiet -e '.[bench,peers]'
	$(PY) -m bench.peers $(PEERS_ARGS)
