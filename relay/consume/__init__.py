"""The inbox's runner: broker deliveries to ``outbox.inbox.Inbox``, acked after its commit.

- relay.consume.deliveries: ``Delivery`` (one message from a broker, with its ack,
  retry and reject) and ``Subscription`` (what each broker gives the runner);
- relay.consume.runner: ``Consumer``, the loop (`outbox consume`, ``Inbox.run``);
- relay.consume.nats: NATS JetStream durable pull consumers, one per stream that
  captures the inbox's patterns;
- relay.consume.redis: Redis Streams consumer groups, entries of dead processes claimed;
- relay.consume.rabbitmq: a quorum queue per consumer, bound to its patterns;
- relay.consume.subjects: which subjects overlap, in NATS's wildcard syntax.
"""
