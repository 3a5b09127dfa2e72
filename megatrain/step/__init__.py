"""One step on the executor: the streaming engine, its layer templates, recompute blocks, tiling, warm-up and
profiling."""
