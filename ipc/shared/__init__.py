"""Shared memory itself: segments with checked headers, their mappings, the sweeper and reaper, and memory fences."""
