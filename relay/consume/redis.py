"""Redis Streams for the inbox: a consumer group named after the inbox's consumer on
every stream whose topic one of its patterns matches.

The relay writes each topic to its own stream, ``<prefix><topic>`` (relay.brokers.redis).
Redis has no wildcard subscription, so the streams are found with SCAN (stream keys
under the URL's prefix) at open and again every ``RESCAN_S``; a pattern without
wildcards names its stream, made empty (MKSTREAM) when the topic has none yet. The
group starts at id 0 (the stream's whole history). Each process reads as a consumer
of its own in the group, ``<hostname>-<pid>``, so processes of one consumer share the
entries.

An entry is acked (XACK) after the inbox's commit. A retry leaves it pending: the
process claims it back (XCLAIM, which counts a delivery) once the delay is over, and
while it waits keeps its idle time short (XCLAIM JUSTID, no delivery counted) so that
no other process takes it early. An entry pending longer than ``ack_wait`` (its
process died) is claimed by any process (XAUTOCLAIM). The attempt is the entry's
delivery count in the group (XPENDING), so it survives a restart. An entry the relay
did not write is acked and logged (rejected).

URL: ``redis://host:6379[/db][?prefix=P&ack_wait=SECONDS&timeout=1]``: the relay's key
prefix (default none); how long a pending entry stays with a silent process before
another claims it (default 60 s); the socket timeout.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

import redis.asyncio as aioredis
import redis.exceptions

from outbox.errors import ConfigError, OutboxError
from outbox.secrets import mask_url
from relay.brokers.redis import RETRYABLE, read_fields
from relay.consume.deliveries import Delivery, Subscription
from relay.consume.subjects import intersection

log = logging.getLogger("relay.consume")
ACK_WAIT_S = 60.0  # an entry pending this long with a silent process is claimed by another
RESCAN_S = 5.0  # look for new topics' streams this often
MAX_BLOCK_S = 5.0  # the longest XREADGROUP BLOCK (the socket timeout allows for it)
OUR_OPTIONS = ("prefix", "maxlen", "timeout", "ack_wait")  # the rest is redis-py's

Entry = tuple[bytes, bytes]  # (stream key, entry id)


class RedisSubscription(Subscription):
    def __init__(self, url: str, consumer: str, patterns: Sequence[str]) -> None:
        parts = urlsplit(url)
        query = parse_qs(parts.query)
        theirs = {k: v for k, v in query.items() if k not in OUR_OPTIONS}
        self.url = parts._replace(query=urlencode(theirs, doseq=True)).geturl()
        self.prefix = query.get("prefix", [""])[-1]
        self.timeout = seconds("timeout", query.get("timeout", ["1"])[-1], 0.01)
        self.ack_wait = seconds("ack_wait", query.get("ack_wait", [str(ACK_WAIT_S)])[-1], 1)
        self.group, self.patterns = consumer, list(patterns)
        self.name = f"{socket.gethostname()}-{os.getpid()}"
        self._client: aioredis.Redis | None = None
        self._keys: list[bytes] = []
        self._scanned_at = 0.0
        self._due: dict[Entry, float] = {}  # retries: when to claim each back
        self._kept_at = 0.0
        self._claim_from: dict[bytes, bytes] = {}  # XAUTOCLAIM's cursor per stream
        self._claimed_at = 0.0

    @property
    def client(self) -> aioredis.Redis:
        if self._client is None:
            raise OutboxError("the Redis subscription is not open")
        return self._client

    async def open(self) -> None:
        client = aioredis.from_url(
            self.url,
            socket_timeout=self.timeout + MAX_BLOCK_S,
            socket_connect_timeout=self.timeout,
        )
        try:
            await client.ping()
        except redis.exceptions.RedisError as exc:
            await client.aclose()
            raise OutboxError(f"broker {mask_url(self.url)} unreachable: {exc}") from None
        self._client = client
        await self.rescan()

    async def rescan(self) -> None:
        """Join the group on the streams found since the last scan."""
        self._scanned_at = time.monotonic()
        for key in sorted(await self.stream_keys()):
            if key in self._keys:
                continue
            try:
                await self.client.xgroup_create(key, self.group, id="0", mkstream=True)
            except redis.exceptions.ResponseError as exc:
                if not str(exc).startswith("BUSYGROUP"):  # BUSYGROUP: created before
                    log.warning("consumer %s: stream %r: %s", self.group, key.decode(), exc)
                    continue
            self._keys.append(key)
            log.info("consumer %s: stream %s, group %s", self.group, key.decode(), self.group)

    async def stream_keys(self) -> set[bytes]:
        """The stream keys of the topics the patterns match; a pattern without wildcards
        names its key whether the stream exists or not."""
        keys: set[bytes] = set()
        for pattern in self.patterns:
            if "*" not in pattern.split(".") and ">" not in pattern.split("."):
                keys.add((self.prefix + pattern).encode())
                continue
            async for key in self.client.scan_iter(match=glob(self.prefix, pattern),
                                                   _type="STREAM", count=1000):  # fmt: skip
                if self.captures(key):
                    keys.add(key)
        return keys

    def captures(self, key: bytes) -> bool:
        topic = key.decode("utf-8", "replace")[len(self.prefix) :]
        return any(intersection(p, topic) == topic for p in self.patterns)

    async def fetch(self, most: int, wait_s: float) -> list[Delivery]:
        """Retries that are due first, then entries a dead process left, then new ones."""
        try:
            return await self.take(most, wait_s)
        except RETRYABLE as exc:
            log.warning("consumer %s: redis: %s: %s", self.group, type(exc).__name__, exc)
        except redis.exceptions.ResponseError as exc:
            if not str(exc).startswith("NOGROUP"):
                raise
            log.warning("consumer %s: %s: joining the streams again", self.group, exc)
            self._keys, self._scanned_at = [], 0.0  # a stream was deleted: scan again
        await asyncio.sleep(min(wait_s, 1.0))
        return []

    async def take(self, most: int, wait_s: float) -> list[Delivery]:
        if time.monotonic() - self._scanned_at >= RESCAN_S:
            await self.rescan()
        await self.keep_waiting()
        found = await self.due_retries(most)
        if len(found) < most:
            found += await self.abandoned(most - len(found))
        if found:
            return found
        block = min(wait_s, MAX_BLOCK_S, self.until_next_due())
        if not self._keys:
            await asyncio.sleep(block)
            return []
        per_stream = max(1, most // len(self._keys))
        reply: Any = await self.client.xreadgroup(
            self.group, self.name, dict.fromkeys(self._keys, ">"), count=per_stream,
            block=max(1, int(block * 1000)),
        )  # fmt: skip
        pairs = reply.items() if isinstance(reply, dict) else (reply or [])  # RESP3 or 2
        return [self.delivery(key, eid, fields, 1) for key, entries in pairs
                for eid, fields in entries]  # fmt: skip

    def until_next_due(self) -> float:
        if not self._due:
            return float("inf")
        return max(0.0, min(self._due.values()) - time.monotonic())

    async def due_retries(self, most: int) -> list[Delivery]:
        """Claim back the entries whose retry delay is over (a delivery counted)."""
        now = time.monotonic()
        due = [entry for entry, at in self._due.items() if at <= now][:most]
        for entry in due:
            del self._due[entry]
        return await self.claimed(due, lambda key, ids: self.client.xclaim(
            key, self.group, self.name, 0, ids))  # fmt: skip

    async def abandoned(self, most: int) -> list[Delivery]:
        """Entries pending longer than ``ack_wait`` (their process died): an XAUTOCLAIM
        pass over every stream each ``ack_wait / 2`` (``RESCAN_S`` at most), a page of
        ``most`` per fetch."""
        if not self._claim_from:
            if time.monotonic() - self._claimed_at < min(self.ack_wait / 2, RESCAN_S):
                return []
            self._claimed_at = time.monotonic()
            self._claim_from = dict.fromkeys(self._keys, b"0-0")
        found: list[Delivery] = []
        for key, start in list(self._claim_from.items()):
            reply: Any = await self.client.xautoclaim(
                key, self.group, self.name, int(self.ack_wait * 1000), start, count=most
            )
            if reply[0] in (b"0-0", "0-0"):
                del self._claim_from[key]
            else:
                self._claim_from[key] = reply[0]
            entries = [(eid, fields) for eid, fields in reply[1] if fields is not None]
            found += await self.with_attempts(key, entries)
            if found:
                return found
        return found

    async def claimed(self, due: list[Entry], claim: Any) -> list[Delivery]:
        found: list[Delivery] = []
        for key in dict.fromkeys(k for k, _ in due):
            ids = [eid for k, eid in due if k == key]
            entries = [(eid, fields) for eid, fields in await claim(key, ids) if fields is not None]
            found += await self.with_attempts(key, entries)
        return found

    async def with_attempts(self, key: bytes, entries: list[tuple[bytes, Any]]) -> list[Delivery]:
        """The entries as deliveries, each with its delivery count in the group."""
        if not entries:
            return []
        pipe = self.client.pipeline(transaction=False)
        for eid, _ in entries:
            pipe.xpending_range(key, self.group, eid, eid, 1)
        counts = [rows[0]["times_delivered"] if rows else 1 for rows in await pipe.execute()]
        return [self.delivery(key, eid, fields, n)
                for (eid, fields), n in zip(entries, counts, strict=True)]  # fmt: skip

    async def keep_waiting(self) -> None:
        """Reset the idle time of the entries waiting for their retry (no delivery
        counted), so that no process claims them as abandoned meanwhile."""
        if not self._due or time.monotonic() - self._kept_at < self.ack_wait / 3:
            return
        self._kept_at = time.monotonic()
        for key in dict.fromkeys(k for k, _ in self._due):
            ids: list[Any] = [eid for k, eid in self._due if k == key]
            await self.client.xclaim(key, self.group, self.name, 0, ids, justid=True)

    def delivery(self, key: bytes, eid: bytes, fields: Mapping[bytes, bytes], n: int) -> Delivery:
        topic = key.decode("utf-8", "replace")[len(self.prefix) :]
        msg_id, headers = parsed(fields)

        async def ack() -> None:
            await self.client.xack(key, self.group, eid)

        async def retry(delay_s: float) -> None:
            self._due[(key, eid)] = time.monotonic() + delay_s

        async def reject() -> None:
            log.warning("consumer %s: entry %s of %s rejected (acked, not handled)",
                        self.group, eid.decode(), key.decode("utf-8", "replace"))  # fmt: skip
            await self.client.xack(key, self.group, eid)

        return Delivery(msg_id, topic, fields.get(b"payload", b""), headers, n, ack, retry, reject)

    async def lag(self) -> int | None:
        """The group's entries not yet delivered (Redis 7's lag) plus those pending."""
        total = 0
        for key in self._keys:
            for group in await self.client.xinfo_groups(key):
                name = group.get("name")
                if (name.decode() if isinstance(name, bytes) else name) != self.group:
                    continue
                lag = group.get("lag")
                if lag is None:  # Redis < 7 or a trimmed stream: unknown
                    return None
                total += int(lag) + int(group.get("pending") or 0)
        return total

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is None:
            return
        try:
            await self.leave(client)
        except redis.exceptions.RedisError as exc:
            log.info("consumer %s: leaving the group: %s", self.group, exc)
        finally:
            await client.aclose()
            self._keys, self._due = [], {}

    async def leave(self, client: aioredis.Redis) -> None:
        """Take this process's name out of the groups where it holds no pending entry
        (one that holds some stays, for another process to claim them)."""
        for key in self._keys:
            for info in await client.xinfo_consumers(key, self.group):
                if info["name"] in (self.name, self.name.encode()) and not info["pending"]:
                    await client.xgroup_delconsumer(key, self.group, self.name)


def parsed(fields: Mapping[bytes, bytes]) -> tuple[str | None, dict[str, str]]:
    """The msg_id and headers the relay wrote; no msg_id for an entry it did not."""
    try:
        msg_id, headers = read_fields(dict(fields))
    except ValueError:
        return None, {}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
        return None, {}
    return msg_id, headers


def glob(prefix: str, pattern: str) -> str:
    """A SCAN pattern for the keys of the topics ``pattern`` matches (and some more: a
    glob's ``*`` crosses dots; ``captures`` filters)."""
    tokens = ("*" if t in ("*", ">") else re.sub(r"([*?\[\]\\])", r"\\\1", t)
              for t in pattern.split("."))  # fmt: skip
    return re.sub(r"([*?\[\]\\])", r"\\\1", prefix) + ".".join(tokens)


def seconds(name: str, text: str, least: float) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not least <= value <= 86400:
        raise ConfigError(f"broker: {name!r} must be seconds from {least:g} to 86400, got {text!r}")
    return value
