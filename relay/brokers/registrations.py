"""The product's three brokers as they declare themselves (``outbox.brokers_registry``).

pyproject.toml lists these objects in the entry-point group ``outbox.brokers``. This
module imports no broker client: an install without the broker's extra loads it, and
only making an adapter (``relay.brokers.broker_for``) imports the client. Each broker's
wire limits live here, beside its schemes: ``send()`` refuses what any broker would.
"""

from __future__ import annotations

from outbox.brokers_registry import BrokerRegistration, WireLimits

# AMQP 0-9-1 short strings (the routing key, header names, content_type): 255 bytes.
AMQP_SHORTSTR_BYTES = 255
# JetStream refuses a header block over 65,535 bytes (a 16-bit length); RabbitMQ, which
# carries all headers in one frame of at most frame_max (128 KiB by default), has room.
NATS_MAX_HEADER_BYTES = 65_535

NATS = BrokerRegistration(
    family="nats",
    schemes=("nats", "tls"),  # tls://: NATS over TLS
    extra="nats",
    adapter="relay.brokers.nats:NatsBroker",
    client_modules=("nats",),
    log_source_flags=("--stream",),  # JetStream streams
    limits=WireLimits(
        max_header_bytes=NATS_MAX_HEADER_BYTES,
        reserved_header_prefixes=("nats-",),  # Nats-Msg-Id and the server's own
    ),
    harness="relay.testing.harness:nats_under_test",
)

RABBITMQ = BrokerRegistration(
    family="rabbitmq",
    schemes=("amqp", "amqps"),
    extra="rabbitmq",
    adapter="relay.brokers.rabbitmq:RabbitBroker",
    client_modules=("aio_pika", "aiormq"),
    log_source_flags=("--queue",),  # the audit stream queue
    limits=WireLimits(
        max_topic_bytes=AMQP_SHORTSTR_BYTES,
        max_header_name_bytes=AMQP_SHORTSTR_BYTES,
        max_content_type_bytes=AMQP_SHORTSTR_BYTES,
        # Sender-selected distribution: RabbitMQ routes a message to the routing keys in
        # these headers too, so through them it would reach queues its topic does not.
        reserved_header_names=frozenset({"cc", "bcc"}),
    ),
    harness="relay.testing.harness:rabbitmq_under_test",
)

REDIS = BrokerRegistration(
    family="redis",
    schemes=("redis", "rediss"),
    extra="redis",
    adapter="relay.brokers.redis:RedisBroker",
    client_modules=("redis",),
    log_source_flags=("--stream",),  # a topic's stream
    limits=WireLimits(),  # a stream key and its fields take what send() allows
    harness="relay.testing.harness:redis_under_test",
)
