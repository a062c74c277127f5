"""Collective algorithms as pure peer math.

Each module builds a :class:`~plait.algorithms.schedule.Schedule` for one rank: a list of
steps, each a set of local copies/reductions followed by sends and receives that run
concurrently. Algorithms never touch a transport; the executor runs schedules, and tests
run them in one process for world sizes 1-64.
"""
