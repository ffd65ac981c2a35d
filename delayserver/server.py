"""The delay server process: the scheduler behind a ``FrameServer``, dispatching to realtime
brokers found through the MetaServer, registered as a delay group, stopped gracefully
(``serverkit.server.ServerBase`` holds the start-up and shutdown it shares with the realtime
broker)."""

from __future__ import annotations

import logging
from functools import partial
from typing import Any, Awaitable, Callable

from delayserver.config import DelayConfig
from delayserver.metrics import DelayMetrics
from delayserver.dispatch import Hold
from delayserver.accepting import _PendingCall
from delayserver.scheduler import Dispatch, Scheduler
from delayserver.storage.done_journal import GATED_KINDS, gated_kind_at
from delayserver.tracing import DelayTracer
from logstore.fileio import Opener, OsFile
from serverkit.access import Grant
from serverkit.frame_server import Later, Session
from serverkit.kind_gate import RecordKinds
from serverkit.payload_sender import PayloadSender
from serverkit.replica_log import ReplicatedLog
from serverkit.replication import ReplicationStatus
from serverkit.server import ServerBase, tune_gc
from wire.errors import Forbidden, NotSupported
from wire.protocol import Cancel, Hello, Request, Send, cancel_result, send_stored_answer
from wire.replication import Fetch, Snapshot

# The done journal's handed and dropped records: replicated only to slaves that read them.
DONE_KINDS = RecordKinds(GATED_KINDS, gated_kind_at)

log = logging.getLogger(__name__)



class DelayServer(ServerBase):
    """A running delay server: ``await start()`` recovers, listens and registers.

    Threads: every field is the event loop's. The scheduler's store runs on its own delay-io
    thread and the trace writer on its own thread (their docstrings say what they share).
    """

    KIND = "delay"
    REPLICATED_LOGS = ("delay", "done")
    # A slave's fetch at the log's end parks with no task (``serverkit.parked_fetch``): stepped
    # as it is read, it needs a task only when it reads the store's thread. A send queues its
    # commit and returns its call, a ``Later`` the commit's hand-back answers
    # (``_schedule_ended``): no task, no coroutine waiting for the commit.
    INLINE_OPS = ("send", "fetch")
    STOP_SUMMARY = ("queued sends committed, dispatches recorded, delay store fsynced and "
                    "checkpointed")

    def __init__(
        self,
        config: DelayConfig,
        clock: Callable[[], int] | None = None,
        dispatch: Dispatch | None = None,
        opener: Opener = OsFile,
        replication: ReplicationStatus | None = None,
    ) -> None:
        if dispatch is None and not config.meta_url:
            raise ValueError("a delay server needs meta_url (or a dispatch function) to "
                             "reach realtime brokers")
        metrics = DelayMetrics(config.group)
        super().__init__(config, metrics, clock, replication)
        self.config: DelayConfig = config
        self.metrics: DelayMetrics = metrics
        self._sender: PayloadSender | None = None
        if dispatch is None:
            # Dispatches go to realtime brokers under this server's own token.
            self._sender = PayloadSender(config.meta_url, kind="realtime",
                                         client_id=f"delay-{config.group}", token=config.token,
                                         ssl_context=self.peer_ssl)
            dispatch = self._sender.send
        # Only a leased master dispatches (docs/REPLICATION.md 5): a slave, or an old master
        # that lost its lease, is refused and its scheduler retries with backoff.
        self._dispatch = metrics.observe_dispatch(self._fenced(dispatch))
        # The hand-off ahead of the due time goes through the same sender (with the same
        # fencing); a server given its own dispatch function (tests) dispatches at the due time.
        self._hold: Hold | None = None
        if self._sender is not None:
            sender = self._sender

            async def hold(subject: str, payloads: list[bytes], visible_at_ms: list[int]
                           ) -> tuple[str, list[dict[str, Any]]]:
                """Hand ``payloads`` to their broker, to be visible at ``visible_at_ms``."""
                return await sender.send(subject, payloads, visible_at_ms)

            # An older broker's refusal (not_supported) is the hand-off's normal fallback.
            self._hold = metrics.observe_dispatch(  # type: ignore[arg-type]
                self._fenced(hold), uncounted=(NotSupported.code,))
        self._opener = opener
        self._scheduler: Scheduler | None = None  # built by start(), once its store is open

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler over this server's store (there once ``start`` opened the store)."""
        if self._scheduler is None:
            raise RuntimeError(f"delay group {self.config.group} is not started")
        return self._scheduler

    def _fenced(self, dispatch: Dispatch) -> Dispatch:
        """``dispatch`` that only a leased master may make: it waits while the role settles
        (overdue messages are due before the first registration answers), then a slave or a
        fenced old master gets NotMaster, which the scheduler retries with its backoff."""

        async def fenced(subject: str, payloads: list[bytes], *more: Any
                         ) -> tuple[str, list[dict[str, Any]]]:
            """``dispatch(subject, payloads, *more)`` once this server is the leased master."""
            await self._settle_role()
            self._check_role()
            return await dispatch(subject, payloads, *more)  # type: ignore[call-arg]

        return fenced

    async def _open_core(self) -> None:
        tune_gc()
        replica = self.replica
        # A replicated server opens its store as a copy: the MetaServer's first answer decides
        # whether it promotes it (master) or follows a master (slave).
        scheduler = self._scheduler = await Scheduler.open(
            self.config, self.clock, self._dispatch, self._opener,
            tracer=DelayTracer(self.trace), on_fsync=self.metrics.fsync_seconds.observe,
            replica=replica, follower=replica is not None, hold=self._hold,
            cancel_held=self._sender.cancel_held_answers if self._sender is not None
            else None)
        self.metrics.watch(scheduler)
        scheduler.answers_together = self.frames.answers_together()  # its one block
        if replica is not None:
            store = scheduler.store
            replica.attach([
                # The store cannot cut its copy back (delayserver/storage/copying.py): a
                # diverging or rotten delay log or journal throws both away together.
                ReplicatedLog("delay", store.delay_copy, replica.histories["delay"],
                              scheduler.on_io, empties=("done",)),
                ReplicatedLog("done", store.done_copy, replica.histories["done"],
                              scheduler.on_io, requires=("delay",), reset_with="delay",
                              kinds=DONE_KINDS),
            ], scheduler, self.role, self._heartbeat_soon)
        await scheduler.start()

    def _core(self) -> Scheduler:
        return self.scheduler

    def _report(self) -> Awaitable[dict[str, Any]]:
        return self.scheduler.report()

    async def _close_core(self) -> None:
        if self.replica is not None:
            await self.replica.close()
        if self._scheduler is not None:
            await self._scheduler.stop()
        if self._sender is not None:
            await self._sender.close()

    def handle_now(self, session: Session, request: Request, grant: Grant | None = None
                   ) -> dict[str, Any] | Later | Awaitable[dict[str, Any] | Later]:
        """Answer one data-plane request, after checking what the connection's token allows:
        at once when it can (a hello), else the awaitable that goes on with it (a send waits
        for its commit; ``ServerBase.handle_now``). ``grant`` is given only by ``_granted``
        and ``_role_renewed``, which awaited for a request this call already counted."""
        if grant is None:
            self.metrics.count_request(request.op)
            # Asked per request, not once per hello, so a revoked token stops within the cache
            # TTL; a fresh cached answer is one call and no coroutine (as the realtime broker
            # asks).
            grant = self.gate.grant_now(session.token)
            if grant is None:
                return self._granted(session, request)  # asks the MetaServer, then here again
        # Told apart by their exact type (request types are never subclassed), a send first.
        if type(request) is not Send:
            if type(request) is Hello:
                return self._hello()
            if type(request) is Fetch or type(request) is Snapshot:
                return self._serve_replica(request, grant)
        # Only the leased master serves, and it checks again before answering (a write whose
        # commit outlived the lease is not acknowledged): the role's own check, the usual
        # case in one call.
        if not self.role.writable_now():
            # A lapsed lease: renewed at once, then here again (or NotMaster).
            return self._role_renewed(session, request, grant)
        if type(request) is Send:
            return self._scheduled(request, grant)
        if isinstance(request, Cancel):
            # A cancel names no subject: any token that may produce somewhere may cancel.
            if not (grant.admin or grant.produce):
                raise Forbidden(f"app {grant.app!r} may not cancel: its token has no produce "
                                "patterns")
            return self._cancelled(request)
        raise NotSupported(f"op {request.op} is not served by delay servers; "
                           "pull and ack go to realtime brokers")

    async def _granted(self, session: Session, request: Request) -> dict[str, Any] | Later:
        """``handle_now`` for a request whose grant was not cached: asked, then served."""
        grant = await self.gate.grant(session.token, session.app)
        out = self.handle_now(session, request, grant)
        if isinstance(out, (dict, Later)):
            return out
        return await out

    async def _role_renewed(self, session: Session, request: Request, grant: Grant
                            ) -> dict[str, Any] | Later:
        """``handle_now`` for a request that found the role refusing: the lease renewed at
        once (or NotMaster), then served (the access checks, pure, are asked again)."""
        await self._check_role_renewed()
        out = self.handle_now(session, request, grant)
        if isinstance(out, (dict, Later)):
            return out
        return await out

    def _scheduled(self, request: Send, grant: Grant) -> dict[str, Any] | Later:
        """A send (access and role checked): queued for the group commit, its call returned as
        the request's ``Later`` and answered by ``_schedule_ended`` from the commit's
        hand-back, with no task waiting (issue 18); the results now when none is valid."""
        # The grant is checked inside ``schedule_soon`` against the subjects its quick check
        # reads, before anything is written: no second read of each payload here.
        sent = self.scheduler.schedule_soon(
            request.messages, request.compact,
            None if grant.admin else partial(self.gate.check_send, grant),
            self._schedule_ended)
        if type(sent) is not list:
            return sent  # type: ignore[return-value]  # its own Later: _schedule_ended
        self.metrics.count_schedule_results(sent)  # nothing valid to commit
        self._check_role()
        return {"results": sent}

    def _schedule_ended(self, call: _PendingCall) -> None:
        """A send's commit ended (stored or refused): answer it (the call is its own
        ``Later``), after the slaves under ``sync`` replication (a commit's answers are
        parked once per commit by ``_park_answers``; a call still holding ``delay_end`` was
        not: NotMaster now, or waited for here), and only while still the writable master."""
        try:
            if call.error is not None:
                raise call.error
            end = call.delay_end
            if end:
                call.delay_end = 0
                replica = self.scheduler.replica
                if not replica.replicated_now("delay", end):  # raises NotMaster
                    replica.park_replicated("delay", end,
                                            partial(self._schedule_replicated, call))
                    return
            if call.compact:  # every message stored: answered by their count
                count = len(call.ids)
                self.metrics.scheduled += count
                if not self.role.writable_now():
                    self._check_role()  # raises: a write that outlived the lease is not answered
                answer = send_stored_answer(count)
            else:
                results = call.results
                self.metrics.count_schedule_results(results)
                self._check_role()
                answer = {"results": results}
        except Exception as exc:  # NotMaster, or a server bug: answered internal and logged
            call.fail(exc)
            return
        call.answer(answer)

    def _schedule_replicated(self, call: _PendingCall, error: BaseException | None) -> None:
        """``_schedule_ended``'s wait for the slaves ended: answered, or refused."""
        if error is not None:
            call.error = error
        self._schedule_ended(call)

    async def _cancelled(self, request: Cancel) -> dict[str, Any]:
        """A cancel (access and role checked): each message's status."""
        results = []
        for message_id, deliver_at_ms in zip(request.ids, request.deliver_at_ms):
            status = await self.scheduler.cancel(message_id, deliver_at_ms)
            self.metrics.count_cancel(status)
            results.append(cancel_result(message_id, status))
        self._check_role()
        return {"results": results}


__all__ = ["DelayServer"]
