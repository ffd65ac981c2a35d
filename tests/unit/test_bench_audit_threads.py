"""bench.audit's CPU by kind of thread: the names a JVM and the qmq process give their threads."""

from __future__ import annotations

import os

import pytest

from bench.audit import cpu_by_kind, thread_kind


@pytest.mark.parametrize("name, kind", [
    ("C2 CompilerThre", "JIT C2"),
    ("C1 CompilerThre", "JIT C1"),
    ("Executor task l", "tasks"),
    ("Executor task i", "tasks"),
    ("Thread-3", "driver (py4j)"),
    ("G1 Conc#0", "GC"),
    ("GC Thread#1", "GC"),
    ("VM Thread", "GC"),
    ("python", "python"),
    ("java", "JVM main"),
    ("dag-scheduler-e", "other"),
])
def test_a_thread_name_gives_its_kind(name, kind):
    assert thread_kind(name) == kind


def test_cpu_by_kind_sums_the_threads_of_a_kind_in_seconds_largest_first():
    tick = os.sysconf("SC_CLK_TCK")
    threads = {(1, 1): ("C2 CompilerThre", 2 * tick), (1, 2): ("Executor task l", tick),
               (1, 3): ("Executor task l", 2 * tick), (2, 4): ("python", tick)}
    assert list(cpu_by_kind(threads).items()) == [("tasks", 3.0), ("JIT C2", 2.0),
                                                  ("python", 1.0)]
