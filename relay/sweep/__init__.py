"""The sweep side: what the fast path did not publish, from the table.

The sweeper, which coordinates its claims (claims), the wave publisher (waves) and the
marking it shares with the fast path (relay.fastpath.marking); its jobs, the scheduler,
dead letters."""
