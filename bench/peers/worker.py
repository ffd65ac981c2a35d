"""A client process of the peers benchmark: one role of one workload against one system.

    python -m bench.peers.worker SYSTEM URL ROLE PARAMS_JSON OUT_FILE

SYSTEM is pyqmq, nats or redis; ROLE one of ROLES. A consumer (and the Redis mover) prints
``ready`` on stdout once it is receiving; every role writes its figures as JSON to OUT_FILE
(``{"error": ...}`` when it failed) and exits. The orchestrator (bench/peers/run.py) starts it
with the interpreter that has the system's client library: the project's venv for pyqmq, the
peers' venv for the others (see bench/peers/install.py).
"""

from __future__ import annotations

import asyncio
import json
import sys
import traceback
from typing import Any

from bench.peers import workloads

ROLES = ("consume", "produce_batched", "produce_rate", "produce_delayed", "mover")


def make_driver(system: str, url: str) -> Any:
    """The driver of ``system`` (imported here, so each venv imports only its own)."""
    if system == "pyqmq":
        from bench.peers.drivers_pyqmq import PyqmqDriver
        return PyqmqDriver(url)
    if system == "nats":
        from bench.peers.drivers_nats import NatsDriver
        return NatsDriver(url)
    if system == "redis":
        from bench.peers.drivers_redis import RedisDriver
        return RedisDriver(url)
    raise ValueError(f"unknown system {system!r}: expected pyqmq, nats or redis")


def _ready() -> None:
    print("ready", flush=True)


async def run_role(system: str, url: str, role: str, params: dict[str, Any]) -> dict[str, Any]:
    """Open the driver, play ``role`` with ``params``, close the driver."""
    driver = make_driver(system, url)
    await driver.open()
    try:
        subject = params["subject"]
        if role == "consume":
            return await workloads.consume(driver, subject, params["count"], params["timeout_s"],
                                           params["delayed"], _ready)
        if role == "produce_batched":
            return await workloads.produce_batched(driver, subject, params["count"],
                                                   params["cpu_pids"])
        if role == "produce_rate":
            return await workloads.produce_at_rate(driver, subject, params["count"],
                                                   params["rate_per_s"], params["cpu_pids"])
        if role == "produce_delayed":
            return await workloads.produce_delayed(
                driver, subject, params["count"], lead_ms=params.get("lead_ms", 0),
                delay_low_ms=params.get("delay_low_ms", 0),
                delay_high_ms=params.get("delay_high_ms", 0),
                cpu_pids=tuple(params.get("cpu_pids", ())))
        if role == "mover":
            return await driver.run_mover(subject, params["count"], params["timeout_s"], _ready)
        raise ValueError(f"unknown role {role!r}: expected one of {', '.join(ROLES)}")
    finally:
        await driver.close()


def main(argv: list[str]) -> int:
    system, url, role, params_json, out = argv
    try:
        result = asyncio.run(run_role(system, url, role, json.loads(params_json)))
        code = 0
    except BaseException as exc:  # reported to the orchestrator, which fails the run loudly
        result = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"}
        code = 1
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
