"""The sweep side: what the fast path did not publish, from the table.

The sweeper, its jobs, the scheduler, dead letters."""
