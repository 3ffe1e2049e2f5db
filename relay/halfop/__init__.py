"""Model B, for comparison with the outbox: RocketMQ-style transactional messages.

- ``relay.halfop.protocol``: stream and subject names, message properties, the
  ``LocalTransactionState`` answers, ``TransactionMessage`` and ``TransactionListener``.
- ``relay.halfop.producer``: ``TransactionProducer`` (the app side; its
  ``drop_end_requests`` option is the "end requests lost" fault) and
  ``SqlTransactionListener`` (records each committed transaction for check-back).
- ``relay.halfop.link``: the NATS connection a producer sends halfs and end requests on.
- ``relay.halfop.coordinator``: the broker side (``outbox coordinator``): end
  transactions and check-back.

The producer, link and coordinator need the ``nats`` extra; the protocol does not.
"""
