"""Delay server (not built yet: issue "Delay server").

Will hold the delay message log, the schedule-log time buckets on disk, the in-memory timing wheel
for the preload window, the dispatcher and the per-bucket dispatch log. Nothing here works yet.
"""
