"""The server commands of the ``qmq`` command line (``qmq up|metaserver|realtime|delay``): their
settings from the flags and the ``--config`` file, and the launcher's call. Apart from
``qmq.cli`` for its size; only the server commands import it, so a client command loads none of
this (tests/unit/test_layout.py).
"""

from __future__ import annotations

import argparse
from typing import Any

from qmq.cli import metrics_port_for


def backoff_option(text: str | None) -> dict[str, tuple[int, ...]]:
    """``--retry-backoff-ms 100,200`` as a RealtimeConfig keyword (nothing when not given)."""
    if text is None:
        return {}
    try:
        return {"retry_backoff_ms": tuple(int(part) for part in text.split(","))}
    except ValueError:
        raise ValueError(f"--retry-backoff-ms {text!r} must be comma-separated integers") from None


def server_settings(args: argparse.Namespace, config_class: type, section: str,
                     from_flags: dict[str, Any], data_port: int | None = None) -> Any:
    """``config_class`` from the flags and the ``--config`` file's ``[section]``: a flag given
    wins over the file, the file over the flags' defaults."""
    from qmq import config_file

    from_file = (config_file.settings(config_class, args.config, section, args.config_data)
                 if args.config else {})
    merged = config_file.merge(from_flags, from_file, args.explicit)
    if data_port is not None and ("metrics_port" not in from_file
                                  or "metrics_port" in args.explicit):  # data port + 10 unless told
        merged["metrics_port"] = metrics_port_for(merged.get("port", data_port),
                                                  args.metrics_port, not args.no_metrics)
    if merged.get("data_dir") is None and "data_dir" in from_flags:
        raise ValueError(f"data_dir: give --data-dir, or data_dir in [{section}] of --config")
    return config_class(**merged)


async def run_server(args: argparse.Namespace) -> int:
    """``qmq up|metaserver|realtime|delay``: the only commands that load server code."""
    from qmq import launcher

    if args.command == "up":
        await launcher.run_up(args.data_dir, args.meta_port, args.realtime_port, args.delay_port,
                              args.host, advertise_host=args.advertise_host,
                              flush=args.flush, clock_offset_ms=args.clock_offset_ms,
                              trace=not args.no_trace, admin_token=args.admin_token,
                              replicas=args.replicas, **up_options(args))
        return 0
    if args.command == "metaserver":
        from metaserver.config import MetaConfig

        await launcher.run_metaserver_command(server_settings(args, MetaConfig, "metaserver", dict(
            db_url=args.db, host=args.host, port=args.port, admin_token=args.admin_token,
            tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca,
            schedule_misfire_grace_ms=args.schedule_misfire_grace_ms,
            schedule_lease_ms=args.schedule_lease_ms, trace_dirs=tuple(args.trace_dirs),
            broker_expiry_ms=args.broker_expiry_ms, lease_ms=args.lease_ms,
            lease_margin_ms=args.lease_margin_ms)))
        return 0
    common = dict(data_dir=args.data_dir, meta_url=args.meta, group=args.group, host=args.host,
                  advertise_host=args.advertise_host, port=args.port, flush=args.flush,
                  clock_offset_ms=args.clock_offset_ms, trace=not args.no_trace,
                  trace_dir=args.trace_dir, token=args.token, tls_cert=args.tls_cert,
                  tls_key=args.tls_key, tls_ca=args.tls_ca, replication=args.replication,
                  min_insync=args.min_insync)
    for key in ("scrub_bytes_per_s", "scrub_pause_ms"):  # absent: the config's default
        if getattr(args, key) is not None:
            common[key] = getattr(args, key)
    if args.command == "realtime":
        from realtime.config import RealtimeConfig

        await launcher.run_realtime_command(server_settings(args, RealtimeConfig, "realtime", dict(
            common, ack_timeout_ms=args.ack_timeout_ms, consumer_expiry_ms=args.consumer_expiry_ms,
            retries_max=args.retries_max, **backoff_option(args.retry_backoff_ms)), args.port))
        return 0
    if args.command == "delay":
        from delayserver.config import DelayConfig

        extra = {"max_delay_ms": args.max_delay_ms} if args.max_delay_ms else {}
        if args.handoff_lead_ms is not None:
            extra["handoff_lead_ms"] = args.handoff_lead_ms
        await launcher.run_delay_command(server_settings(args, DelayConfig, "delay", dict(
            common, bucket_ms=args.bucket_ms, wheel_entries_max=args.wheel_entries_max, **extra),
            args.port))
        return 0
    raise AssertionError(f"unhandled server command {args.command}")


# ``qmq up``'s flags that set a field of one of its servers: flag -> ((table, field), ...).
UP_FLAGS = {
    "meta_port": (("metaserver", "port"),), "realtime_port": (("realtime", "port"),),
    "delay_port": (("delay", "port"),), "admin_token": (("metaserver", "admin_token"),),
    "host": (("metaserver", "host"), ("realtime", "host"), ("delay", "host")),
    "advertise_host": (("realtime", "advertise_host"), ("delay", "advertise_host")),
    "flush": (("realtime", "flush"), ("delay", "flush")),
    "ack_timeout_ms": (("realtime", "ack_timeout_ms"),),
    "consumer_expiry_ms": (("realtime", "consumer_expiry_ms"),),
    "retries_max": (("realtime", "retries_max"),),
    "retry_backoff_ms": (("realtime", "retry_backoff_ms"),),
    "realtime_metrics_port": (("realtime", "metrics_port"),),
    "delay_metrics_port": (("delay", "metrics_port"),),
}


def up_options(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """``qmq up``'s per-server settings beyond its own: the ``--config`` file's tables, then the
    flags given explicitly (which win)."""
    from delayserver.config import DelayConfig
    from metaserver.config import MetaConfig
    from qmq import config_file
    from realtime.config import RealtimeConfig

    options: dict[str, dict[str, Any]] = {"metaserver": {}, "realtime": {}, "delay": {}}
    if args.config:
        for section, cls in (("metaserver", MetaConfig), ("realtime", RealtimeConfig),
                             ("delay", DelayConfig)):
            options[section] = config_file.settings(cls, args.config, section, args.config_data)
    flag_values = {**vars(args), **backoff_option(args.retry_backoff_ms)}
    for flag in args.explicit & set(UP_FLAGS):
        for section, field in UP_FLAGS[flag]:
            options[section][field] = flag_values[flag]
    # A metrics port neither flag nor file gives: the server's data port (the file's, if it
    # moved it) + METRICS_PORT_OFFSET, as `qmq realtime` and `qmq delay` do.
    for section, port_flag in (("realtime", "realtime_port"), ("delay", "delay_port")):
        if "metrics_port" not in options[section]:
            port = options[section].get("port", getattr(args, port_flag))
            options[section]["metrics_port"] = metrics_port_for(port, None)
    return {"meta_options": options["metaserver"], "realtime_options": options["realtime"],
            "delay_options": options["delay"]}


__all__ = ["UP_FLAGS", "backoff_option", "run_server", "server_settings", "up_options"]
