"""Algorithm selection (and, with the topology work, the cost model)."""
