"""How committed messages reach the broker: dispatcher, time wheel, sweeper, brokers."""
