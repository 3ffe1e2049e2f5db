"""Model B, the comparison lab: RocketMQ's half/op model and the comparison of both models.

Opt-in: the product reaches it only through registration."""
