"""I/O threads carry their names into the OS, so per-thread CPU (bench.path_cpu, top -H) can
tell the event loop, the store thread and the pull-log thread apart."""

from __future__ import annotations

import os
import threading

from bench._cluster import thread_cpu_s
from bench.path_cpu import _by_thread
from serverkit.io_thread import IoThread


def os_name(tid: int) -> str:
    with open(f"/proc/{os.getpid()}/task/{tid}/comm", encoding="utf-8") as f:
        return f.read().strip()


async def test_an_io_threads_os_name_is_its_name_cut_to_fifteen_bytes():
    io = IoThread("realtime-pulllog-io")
    try:
        tid = await io.call(threading.get_native_id)
        assert os_name(tid) == "realtime-pulllo"
        assert "realtime-pulllo" in thread_cpu_s(os.getpid())
    finally:
        io.close()


def test_thread_cpu_names_the_main_thread_main():
    assert "main" in thread_cpu_s(os.getpid())


def test_cpu_per_message_by_thread_keeps_io_threads_apart_and_sums_the_rest():
    before = {"main": 1.0, "realtime-store-": 0.5, "trace-realtime": 0.1}
    after = {"main": 1.5, "realtime-store-": 0.7, "realtime-pulllo": 0.1, "delay-io": 0.0,
             "trace-realtime": 0.2, "python": 0.05}
    per_message = _by_thread(before, after, 1000)
    assert {name: round(us) for name, us in per_message.items()} == {
        "main": 500, "realtime-store-": 200, "realtime-pulllo": 100, "delay-io": 0,
        "other": 150}
