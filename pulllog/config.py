"""Settings of a pull-log store (``PullLogConfig``) and what opening one found (``PullLogRecovery``).

Split from ``pulllog.store`` so the store's module holds only the store.
"""

from __future__ import annotations

from dataclasses import dataclass

from logstore import RecoveryReport, Truncation
from logstore.segment_log import FLUSH_MODES

SEGMENT_SIZE_BYTES_MIN = 1024  # smaller segments would hold only a handful of actions


@dataclass(frozen=True)
class PullLogConfig:
    """Settings of one pull-log store."""

    segment_size_bytes_max: int = 16 << 20  # action-log segments roll before passing this size
    flush_mode: str = "async"  # "async": tick() fsyncs every flush_interval_ms; "sync": every call
    flush_interval_ms: int = 100  # async mode: longest time an action stays unsynced while ticking
    checkpoint_every_actions: int = 100_000  # write a checkpoint after this many actions
    checkpoints_kept: int = 3  # checkpoint files kept; action segments are kept back to the oldest
    action_size_bytes_max: int = 16 << 20  # largest action record body (a PULL of a huge batch)

    def __post_init__(self) -> None:
        if self.flush_mode not in FLUSH_MODES:
            raise ValueError(f"flush_mode {self.flush_mode!r} is not one of {FLUSH_MODES}")
        if self.segment_size_bytes_max < SEGMENT_SIZE_BYTES_MIN:
            raise ValueError(
                f"segment_size_bytes_max {self.segment_size_bytes_max} is below the minimum "
                f"{SEGMENT_SIZE_BYTES_MIN}"
            )
        for key in ("flush_interval_ms", "checkpoint_every_actions", "checkpoints_kept",
                    "action_size_bytes_max"):
            value = getattr(self, key)
            if type(value) is not int or value < 1:
                raise ValueError(f"{key} {value!r} must be an integer >= 1")


@dataclass(frozen=True)
class PullLogRecovery:
    """What opening the store found."""

    checkpoint_sequence: int | None  # the checkpoint loaded, None when there was none
    replay_from_offset: int  # action-log offset replay started at
    actions_replayed: int
    log: RecoveryReport  # logstore's report, with the torn-tail truncation if any
    clean_shutdown: bool  # False: the last session crashed, a new pull-seq epoch was started
    epoch: int  # pull-seq epoch in force after opening

    @property
    def truncation(self) -> Truncation | None:
        """What logstore cut from the action log's tail, if anything."""
        return self.log.truncation
