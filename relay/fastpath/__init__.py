"""The fast path: committed messages from memory to the broker within milliseconds.

Dispatcher, lanes, time wheel, acks, slots."""
