"""bench.path_syscalls reads ``perf stat --per-thread`` counts by thread name and takes the
idle window's counts off, per message."""

from __future__ import annotations

from collections import Counter

from bench.path_syscalls import ALL, parse_perf_stat, per_message

PERF_STAT = """# started on Sat Nov 28 04:21:19 2026

python-100,9000,,raw_syscalls:sys_enter,1016634917,100.00,,
realtime-store--102,6000,,raw_syscalls:sys_enter,284367248,100.00,,
python-100,3000,,syscalls:sys_enter_read,1016634917,100.00,,
realtime-store--102,2000,,syscalls:sys_enter_pwrite64,284367248,100.00,,
python-101,40,,raw_syscalls:sys_enter,19987211,100.00,,
python-100,<not counted>,,syscalls:sys_enter_epoll_ctl,0,100.00,,
late-thread-999,7,,raw_syscalls:sys_enter,1,100.00,,
"""


def test_counts_are_summed_by_thread_name_and_a_kind_by_its_system_call():
    names = {"100": "main", "101": "python", "102": "realtime-store-"}
    counts = parse_perf_stat(PERF_STAT, names)
    assert counts["main"] == Counter({ALL: 9000, "read": 3000})
    assert counts["realtime-store-"] == Counter({ALL: 6000, "pwrite64": 2000})
    assert counts["python"] == Counter({ALL: 40})
    # A thread that started after the names were read is known by its comm.
    assert counts["late-thread"] == Counter({ALL: 7})


def test_the_idle_window_is_taken_off_and_a_quiet_thread_left_out():
    busy = {"main": Counter({ALL: 10_100, "read": 3_010}), "python": Counter({ALL: 50})}
    idle = {"main": Counter({ALL: 100, "read": 10}), "python": Counter({ALL: 45})}
    rows = per_message(busy, idle, 1000)
    assert rows == {"main": {ALL: 10.0, "read": 3.0}}
