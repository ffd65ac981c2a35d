"""``bench.replication_wait`` (the split of a sync commit's wait for its slave): its probes still
find every name they wrap, and a commit's steps are matched by offset and time, one commit's
events never lent to another's."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

from bench.replication_wait import OUT_ENV, split

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_probes_find_every_name_they_wrap(tmp_path):
    out = tmp_path / "events.pickle"
    subprocess.run([sys.executable, "-c", "import bench.replication_wait as m; m.install()"],
                   cwd=REPO, env={**os.environ, OUT_ENV: str(out)}, check=True, timeout=120)
    with open(out, "rb") as f:
        assert pickle.load(f) == []  # installed (no AttributeError) and dumped at exit


def commit_events(end: int, start: int, t: int) -> list[tuple]:
    """One commit [start, end) of the message log and its trip, 1 ms a step from ``t``."""
    ms = 1_000_000
    return [
        ("commit", "message", end, t - ms, t),
        ("advanced", "message", end, 0, t + 1 * ms),
        ("read", "message", start, end, t + 2 * ms, t + 3 * ms),
        ("fetch_out", "message", start, end, t + 4 * ms),
        ("ans_in", "message", start, end, t + 5 * ms),
        ("apply", "message", start, end, t + 6 * ms, t + 7 * ms),
        ("req_out", "message", end, 0, t + 8 * ms),
        ("fetch_in", "message", end, 0, t + 9 * ms),
        ("resumed", "message", end, 0, t + 10 * ms),
    ]


def test_each_commit_is_split_into_its_own_steps():
    events = commit_events(100, 0, 1_000_000_000) + commit_events(250, 100, 2_000_000_000)
    events.append(("commit", "message", 400, 0, 3_000_000_000))  # nobody waited: not counted
    steps = split(events, "message")
    assert steps["total"] == [10.0, 10.0]
    assert steps["(master commit)"] == [1.0, 1.0]
    assert steps["wake"] == [1.0, 1.0] and steps["read"] == [1.0, 1.0]
    assert steps["answer->slave"] == [1.0, 1.0] and steps["write+fsync"] == [1.0, 1.0]
    assert steps["fetch->master"] == [1.0, 1.0] and steps["->resumed"] == [1.0, 1.0]
    # The round: the second commit began 1 s after the first; the last has no next one.
    assert steps["(round)"][0] == 1_000.0 and steps["(round)"][1] != steps["(round)"][1]
    assert steps["->next commit"][0] == 1_000.0 - 11.0
    assert split(events, "delay")["total"] == []
