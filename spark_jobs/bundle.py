"""``python -m spark_jobs.bundle FOLDER``: what ``spark-submit`` needs to run the job anywhere.

Writes ``FOLDER/spark_jobs.zip`` (this package, for ``--py-files``: the driver imports
it from there), ``FOLDER/reconcile.py`` (the entry file spark-submit runs) and
``FOLDER/log4j2.properties`` (the driver's quiet logging, for
``-Dlog4j2.configurationFile``), and prints their paths. Standard library only.

The driver's Python still needs the job's libraries: pyspark, pyarrow, jinja2 and plotly
(``pip install 'outbox-relay[spark]'``). The executors run no Python of the job (no
UDFs: every step is Spark SQL), so the zip and these libraries are for the driver.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path

PACKAGE = Path(__file__).parent
SHIPPED = (".py", ".properties", ".typed", ".html")  # .html: the report's templates/
ENTRY = '''"""spark-submit's entry for the reconciliation job (spark_jobs.zip holds the job)."""

import sys

from spark_jobs.reconcile_job import main

sys.exit(main())
'''


def bundle(folder: Path) -> list[Path]:
    """Write the zip, the entry file and the log configuration into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    archive = folder / "spark_jobs.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zipped:
        for path in sorted(PACKAGE.rglob("*")):
            if path.is_file() and path.suffix in SHIPPED and "__pycache__" not in path.parts:
                zipped.write(path, f"spark_jobs/{path.relative_to(PACKAGE).as_posix()}")
    entry = folder / "reconcile.py"
    entry.write_text(ENTRY)
    config = folder / "log4j2.properties"
    shutil.copyfile(PACKAGE / "log4j2.properties", config)
    return [archive, entry, config]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m spark_jobs.bundle", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("folder", type=Path, help="where to write them (created if missing)")
    args = parser.parse_args(argv)
    for path in bundle(args.folder):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
