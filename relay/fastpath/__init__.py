"""The fast path: committed messages from memory to the broker within milliseconds.

Dispatcher (dispatcher), its inbox, the look at the table (checks), the ordering policy
and its lanes (lanes), the time wheel, acks and the marking they share with the sweeper
(acks, marking), slots (stats)."""
