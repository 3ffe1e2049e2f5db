"""`outbox export`: the ledger and the broker log to Parquet, in bounded memory.

Both are streamed in chunks (a server-side cursor for the database; for a broker, its
``LogReader`` (outbox.broker): an ordered consumer for JetStream, XRANGE pages for
Redis, a stream-queue consumer with a prefetch limit for RabbitMQ) and
written batch by batch, so memory does not grow with the number of rows. The
Parquet schemas are spark_jobs.schema's, the reconciliation job's inputs. The ledger
can be written by day (``by_day``: a folder of ``day=YYYY-MM-DD/`` partitions, the UTC
day of ``created_at``), so that the job reads only its window's days.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from itertools import groupby
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from sqlalchemy import Engine, Select, and_, func, or_, select, true

from outbox.broker import LogEntry, LogReader
from outbox.engines import engine_from
from outbox.errors import ConfigError
from outbox.message import KEY_HEADER, SEQ_HEADER
from outbox.table import outbox_message as t
from relay.brokers.base import utc
from spark_jobs.schema import BROKER, LEDGER
from spark_jobs.topics import SOURCES_KEY, capturing, matches, patterns_regex

CHUNK = 50_000
INT64_MAX = 2**63 - 1  # the widest Outbox-Seq a Parquet int64 holds (BIGINT's own bound)
LogRow = dict[str, object]  # a Parquet row: the columns of its schema
Added = Callable[[int], None]  # told each chunk's row count once it is written (progress)


def nothing(_: int) -> None:
    pass


def export_ledger(
    db: str | Engine,
    out: str | Path,
    since: datetime | None = None,
    until: datetime | None = None,
    added: Added = nothing,
    by_day: bool = False,
    topics: Sequence[str] = (),
) -> int:
    """Write outbox_message rows to ``out``: a .parquet file of the rows created in
    [since, until) and of those due in it (scheduled earlier: the night's reconciliation
    must find them), or with ``by_day`` a folder of ``day=YYYY-MM-DD/`` partitions of
    the rows created in it (a row due in it lives in its own day's folder). ``topics``:
    patterns (spark_jobs.topics) a row's topic must match, when given."""
    columns = [t.c[name] for name in LEDGER.names]
    rows = and_(ledger_rows(since, until, by_day), topic_like(topics))
    query = select(*columns).where(rows).order_by(t.c.id)
    return export_rows(db, query, out, LEDGER, added, by_day, topics)


def topic_like(topics: Sequence[str]) -> Any:
    """A SQL condition every topic matching one of ``topics`` meets (LIKE, wildcards as
    ``%``: a few more may meet it; export_rows keeps only the matching ones)."""
    if not topics:
        return true()
    likes = []
    for pattern in topics:
        escaped = pattern.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        tokens = ["%" if token in ("*", ">") else token for token in escaped.split(".")]
        likes.append(t.c.topic.like(".".join(tokens), escape="\\"))
    return or_(*likes)


# How far before a night's window its ledger reaches: a message committed just before the
# window may be delivered inside it, and must not count as a phantom.
LEDGER_LEAD = timedelta(hours=1)


def ledger_topics(
    db: str | Engine, since: datetime | None = None, until: datetime | None = None
) -> set[str]:
    """The topics of the rows ``export_ledger`` writes for [since, until): what a broker
    export must cover (``holding``)."""
    query = select(t.c.topic).where(ledger_rows(since, until, False)).distinct()
    engine = engine_from(db)
    try:
        with engine.connect() as conn:
            return {str(topic) for topic in conn.execute(query).scalars()}
    finally:
        if engine is not db:
            engine.dispose()


def holding(captures: Mapping[str, Sequence[str]], topics: Iterable[str]) -> dict[str, list[str]]:
    """The sources of ``captures`` that capture at least one of ``topics``: a broker's
    other streams (another app's, model B's) are not this ledger's, and their entries
    would read as phantoms."""
    wanted = set(topics)
    return {name: list(subjects) for name, subjects in captures.items()
            if any(capturing({name: subjects}, topic) for topic in wanted)}  # fmt: skip


def ledger_count(
    db: str | Engine,
    since: datetime | None = None,
    until: datetime | None = None,
    by_day: bool = False,
    topics: Sequence[str] = (),
) -> int:
    """How many rows ``export_ledger`` will write (the progress bar's total; with
    ``topics`` a few more may be counted, see ``topic_like``)."""
    rows = and_(ledger_rows(since, until, by_day), topic_like(topics))
    query = select(func.count()).select_from(t).where(rows)
    with engine_from(db).connect() as conn:
        return int(conn.execute(query).scalar_one())


def ledger_rows(since: datetime | None, until: datetime | None, by_day: bool) -> Any:
    """The ledger rows an export of [since, until) holds (see ``export_ledger``)."""
    created = in_range(t.c.created_at, since, until)
    if by_day or (since is None and until is None):
        return created
    return or_(created, in_range(t.c.deliver_at, since, until))


def in_range(column: Any, since: datetime | None, until: datetime | None) -> Any:
    """``column`` in [since, until); either end may be open."""
    return and_(
        true(),
        *([column >= since] if since is not None else []),
        *([column < until] if until is not None else []),
    )


def export_rows(
    db: str | Engine,
    query: Select[Any],
    out: str | Path,
    schema: pa.Schema,
    added: Added = nothing,
    by_day: bool = False,
    topics: Sequence[str] = (),
) -> int:
    """Stream a query's rows (columns in the schema's order) to Parquet via a server-side
    cursor; with ``topics``, only the rows whose topic matches one of them."""
    wanted = patterns_regex(topics) if topics else None
    written = 0
    target = parquet_days(out) if by_day else parquet_file(out, schema)
    with target as writer, engine_from(db).connect() as conn:
        result = conn.execution_options(yield_per=CHUNK).execute(query)
        for rows in result.partitions():
            columns = zip(*rows, strict=True)
            batch = {
                name: [cell(v) for v in column]
                for name, column in zip(schema.names, columns, strict=True)
            }
            table = pa.table(batch, schema=schema)
            if wanted is not None:
                table = table.filter(pc.match_substring_regex(table["topic"], wanted))
            writer.write_table(table)
            written += table.num_rows
            added(len(rows))
    return written


@contextmanager
def parquet_file(out: str | Path, schema: pa.Schema) -> Iterator[pq.ParquetWriter]:
    """A writer whose file appears at ``out`` only once the export succeeded.

    It writes ``.NAME.part`` beside ``out`` and renames it at the end, so a failed
    export leaves no half-written file, and an older ``out`` stays as it was.
    """
    out = Path(out)
    part = out.with_name(f".{out.name}.part")
    try:
        with pq.ParquetWriter(str(part), schema) as writer:
            yield writer
        part.replace(out)
    finally:
        part.unlink(missing_ok=True)


DAY_FOLDER = re.compile(r"day=\d{4}-\d{2}-\d{2}")
# what an interrupted export by day leaves beside its days: a day written, or set aside
LEFTOVER = re.compile(r"\.(day=\d{4}-\d{2}-\d{2})\.(part|old)")


def day_folder_problem(out: str | Path) -> str | None:
    """Why ``out`` may not be written by day: it must be absent, or a folder holding only
    ``day=YYYY-MM-DD`` folders (an earlier export by day), as the days written replace
    theirs there."""
    out = Path(out)
    if not out.exists():
        return None
    if not out.is_dir():
        return "a file; an export by day writes a folder of day=YYYY-MM-DD folders"
    strangers = [p.name for p in out.iterdir()
                 if not (DAY_FOLDER.fullmatch(p.name) or LEFTOVER.fullmatch(p.name))
                 or not p.is_dir()]  # fmt: skip
    if strangers:
        return (f"holds {sorted(strangers)[0]!r}; an export by day writes only into a new "
                "folder or an earlier export by day (day=YYYY-MM-DD folders only)")  # fmt: skip
    return None


class DayFolder:
    """Writes rows under ``.day=YYYY-MM-DD.part/`` by the UTC day of ``created_at``, one
    Parquet file per day (rows come in id order, so a day mostly comes in one run; a day
    that comes back gets a file more). ``swap()`` then puts each day in place."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files: dict[str, int] = {}  # day: files written for it
        self.day: str | None = None
        self.writer: pq.ParquetWriter | None = None

    def write_table(self, table: pa.Table) -> None:
        days = pc.strftime(table["created_at"], format="%Y-%m-%d").to_pylist()  # UTC
        start = 0
        for day, run in groupby(days):
            length = sum(1 for _ in run)
            self.writer_for(day).write_table(table.slice(start, length))
            start += length

    def writer_for(self, day: str) -> pq.ParquetWriter:
        if day != self.day or self.writer is None:
            self.close()
            n = self.files.get(day, 0)
            self.files[day] = n + 1
            folder = self.root / f".day={day}.part"
            folder.mkdir(exist_ok=n > 0)
            self.writer = pq.ParquetWriter(str(folder / f"part-{n:05d}.parquet"), LEDGER)
            self.day = day
        return self.writer

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer, self.day = None, None

    def swap(self) -> None:
        """Each day written replaces its old folder, one at a time: the old one moves
        aside, the new one in, the old one goes; the other days stay as they were."""
        for day in sorted(self.files):
            swap_day(self.root, day)


def swap_day(root: Path, day: str) -> None:
    new, old = root / f".day={day}.part", root / f".day={day}.old"
    current = root / f"day={day}"
    if current.exists():
        current.replace(old)
    new.replace(current)
    shutil.rmtree(old, ignore_errors=True)


def tidy(root: Path) -> None:
    """Undo what an interrupted export left: a day set aside and not replaced comes back,
    days half written go."""
    for path in root.iterdir():
        if (found := LEFTOVER.fullmatch(path.name)) is None:
            continue
        current = root / found[1]
        if found[2] == "old" and not current.exists():
            path.replace(current)
        else:
            shutil.rmtree(path)


@contextmanager
def parquet_days(out: str | Path) -> Iterator[DayFolder]:
    """Write into ``out``, a folder of ``day=YYYY-MM-DD/`` partitions: new, or an earlier
    export by day whose days this one adds or replaces (nightly ``--since`` exports build
    up the year). Nothing is replaced before every row is written; a failed export
    leaves the older days as they were."""
    out = Path(out)
    if problem := day_folder_problem(out):
        raise ConfigError(f"out {out}: {problem}")
    created = not out.exists()
    out.mkdir(exist_ok=True)
    tidy(out)
    days = DayFolder(out)
    try:
        yield days
        days.close()
        days.swap()
    except BaseException:
        days.close()
        if created:  # a failed first export leaves no folder a reader could take for one
            shutil.rmtree(out, ignore_errors=True)
        raise
    finally:
        if out.exists():
            tidy(out)


def cell(value: object) -> object:
    """UUIDs as text and times in UTC, as the Parquet schemas hold them."""
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, datetime):
        return utc(value)
    return value


def log_row(entry: LogEntry) -> LogRow:
    """A row of the broker log export: where and when the broker stored which msg_id,
    and the key and ``Outbox-Seq`` of an ordered message (the job checks its order)."""
    headers = entry.headers
    return {"msg_id": entry.msg_id, "topic": entry.topic, "seq": entry.seq,
            "broker_ts": entry.broker_ts, "key": headers.get(KEY_HEADER),
            "outbox_seq": number(headers.get(SEQ_HEADER)), "malformed": entry.malformed,
            "raw": entry.raw}  # fmt: skip


def number(text: str | None) -> int | None:
    """A header's whole number; None when absent or not one (a stranger's header)."""
    if text is None or not (text.isascii() and text.isdigit()):
        return None
    value = int(text)
    return value if value <= INT64_MAX else None


def export_broker(
    reader: LogReader,
    sources: Sequence[str],
    out: str | Path,
    since: datetime | None = None,
    until: datetime | None = None,
    added: Added = nothing,
    malformed: Added = nothing,
    topics: Sequence[str] = (),
    captures: Mapping[str, Sequence[str]] | None = None,
) -> int:
    """Write what a broker's log holds (stored in [since, until)) to ``out``, for every
    broker alike: ``reader`` is its adapter (``relay.brokers.reader_for(url)``) or a test
    double, ``sources`` where the log is (see ``outbox.broker.LogReader``), read one by
    one so that each row's ``stream`` column names its source. ``topics``: patterns
    (spark_jobs.topics) an entry's topic must match, when given.

    ``captures`` ({source: subjects it captures}, ``log_sources``) goes into the file's
    metadata: the reconciliation tells a topic no source captures (not audited) from a
    lost message by it.

    An entry the relay cannot have written (a stranger's) is a row too, its ``malformed``
    column saying why and ``raw`` holding its fields, escaped; ``malformed`` is told how
    many each chunk held. The reconciliation reports them; they never stop the export."""
    wanted = re.compile(patterns_regex(topics)) if topics else None

    async def rows() -> AsyncIterator[list[LogRow]]:
        default = [None] if captures is None else []  # None: the reader's (the URL's)
        for source in list(sources) or default:
            async for chunk in reader.read_log([source] if source else [], since, until):
                entries = [e for e in chunk if wanted is None or wanted.match(e.topic or "")]
                malformed(sum(1 for entry in entries if entry.malformed is not None))
                if entries:
                    yield [{**log_row(entry), "stream": source} for entry in entries]

    schema = BROKER
    if captures is not None:
        sides = {name: list(subjects) for name, subjects in captures.items()}
        schema = BROKER.with_metadata({SOURCES_KEY: json.dumps(sides).encode()})
    return write_async_chunks(rows(), out, schema, added)


def log_sources(
    reader: LogReader, names: Sequence[str] = (), topics: Sequence[str] = ()
) -> dict[str, list[str]]:
    """Where an export reads the log: {source: subjects it captures}, the ``names`` given
    or by default every source at the broker (``log_sources`` of its adapter); with
    ``topics``, only the sources that may hold one of them (Redis: the topics matching;
    NATS and RabbitMQ: all, their entries filtered as they are read)."""
    listing = getattr(reader, "log_sources", None)
    if listing is None:  # a test double: its sources are what it was given
        return {name: [">"] for name in names}
    found: dict[str, list[str]] = asyncio.run(listing(names))
    if not topics:
        return found
    return {name: subjects for name, subjects in found.items()
            if subjects != [name] or matches(topics, name)}  # fmt: skip


def write_async_chunks(
    chunks: AsyncIterator[list[LogRow]], out: str | Path, schema: pa.Schema, added: Added = nothing
) -> int:
    """Write a reader's chunks to ``out``; nothing appears there if the reader fails."""

    async def write() -> int:
        written = 0
        with parquet_file(out, schema) as writer:
            async for rows in chunks:
                writer.write_table(pa.Table.from_pylist(rows, schema=schema))
                written += len(rows)
                added(len(rows))
        return written

    return asyncio.run(write())
