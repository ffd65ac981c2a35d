"""The realtime server process: the broker behind a ``FrameServer``, registered with the
MetaServer, stopped gracefully on SIGTERM (``serverkit.server.ServerBase`` holds the start-up and
shutdown it shares with the delay server)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from functools import partial
from typing import Any, Awaitable, Callable

from logstore.fileio import Opener, OsFile
from realtime.admin import BrokerAdmin, StorageAdmin
from realtime.broker import Broker
from realtime.config import RealtimeConfig
from realtime.metrics import RealtimeMetrics
from realtime.nacks import NackHandler
from realtime.pulls import ParkedPull, Pulled
from realtime.retries import RetryPolicies
from realtime.sends import SendRequest, Sends
from realtime.storage.control_record import GATED_KINDS, gated_kind_at
from realtime.tracing import BrokerTracer
from serverkit.access import Grant
from serverkit.frame_server import Later, Session
from serverkit.later import _LATER_TYPES
from serverkit.kind_gate import RecordKinds
from serverkit.payload_sender import PayloadSender
from serverkit.replica_log import ReplicatedLog
from serverkit.replication import ReplicationStatus
from serverkit.role import boottime_ms
from serverkit.server import ServerBase, tune_gc
from wire.errors import NotSupported, QmqError
from wire.protocol import (
    Ack, Browse, Cancel, CancelHeld, Heartbeat, Hello, Hold, Leave, Nack, Pull, Purge, Request,
    Send, Subjects, pull_response, send_stored_answer,
)
from wire.replication import Fetch, Snapshot


# The message log's held records (control records): replicated only to slaves that read them.
MESSAGE_KINDS = RecordKinds(GATED_KINDS, gated_kind_at)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Core:
    """What a started realtime server runs: the broker, over storage opened by ``start()``,
    and the request handlers built over it."""

    broker: Broker
    nacks: NackHandler
    admin: BrokerAdmin


class RealtimeServer(ServerBase):
    """A running realtime broker: ``await start()`` recovers, binds and registers, ``await
    stop()`` drains. ``broker``, ``nacks`` and ``admin`` exist from ``start()`` on (the broker
    is built over its opened storage)."""

    KIND = "realtime"
    HOLDS = True  # takes hold/cancel_held: a delay server hands messages off ahead of time
    REPLICATED_LOGS = ("message", "actions")
    STOP_SUMMARY = ("queued sends committed, message log fsynced and checkpointed, pull log "
                    "fsynced and closed")
    # Answered without suspending while the access answer is cached and the pull-log thread
    # is idle (an ack is recorded on the loop then, with no coroutine: ``Holdings.ack_now``;
    # one that waits for the store's thread or a sync slave goes on in a task): no task for
    # them. A slave's fetch at the
    # log's end parks with no task (``serverkit.parked_fetch``), answered through a ``Later``;
    # one that reads the store's thread goes on in a task. A pull that can be answered at once is, and a long
    # poll that waits parks with no task (``Pulls.pull`` with ``direct``, answered through a
    # ``Later``); only one that needs the pull-log or store thread goes on in a task. A send
    # queues its commit and returns a ``Later`` that its commit's done callback answers
    # (``_send_ended``): no task, no coroutine waiting for the commit.
    INLINE_OPS = ("hello", "heartbeat", "ack", "pull", "send", "fetch")

    def __init__(
        self,
        config: RealtimeConfig,
        clock: Callable[[], int] | None = None,
        opener: Opener = OsFile,
        replication: ReplicationStatus | None = None,
    ) -> None:
        metrics = RealtimeMetrics(config.group)
        super().__init__(config, metrics, clock, replication)
        self.config: RealtimeConfig = config
        self.metrics: RealtimeMetrics = metrics
        self._request_counts = metrics.request_counts  # counted by handle, read at scrape time
        self._opener = opener
        self._running: _Core | None = None  # set by start()
        self._retry_sender: PayloadSender | None = None
        if config.meta_url:
            # Retry copies go to delay servers under this broker's own token.
            self._retry_sender = PayloadSender(config.meta_url, kind="delay",
                                               client_id=f"realtime-{config.group}",
                                               token=config.token, ssl_context=self.peer_ssl)

    def _started(self) -> _Core:
        core = self._running
        if core is None:
            raise RuntimeError(f"realtime group {self.config.group} is not started")
        return core

    @property
    def broker(self) -> Broker:
        """The broker (from ``start()`` on)."""
        return self._started().broker

    @property
    def nacks(self) -> NackHandler:
        """Turns nacks into retries and dead letters (from ``start()`` on)."""
        return self._started().nacks

    @property
    def admin(self) -> BrokerAdmin:
        """The admin ops (subjects, browse, purge) over the broker's storage, each step on the
        I/O thread of the store it touches (from ``start()`` on)."""
        return self._started().admin

    async def _open_core(self) -> None:
        config = self.config
        replica = self.replica
        # A replicated server opens its stores as copies: the MetaServer's first answer
        # decides whether it promotes them (master) or follows a master (slave).
        broker = await Broker.open(config, self.clock, self._opener, BrokerTracer(self.trace),
                                   replica=replica, follower=replica is not None)
        if replica is not None:
            replica.attach([
                # A copy that begins at the master's retention point first takes every
                # subject's sequence there (realtime/storage/sequence_starts.py).
                ReplicatedLog("message", broker.store, replica.histories["message"],
                              broker.on_store_thread, snapshots=True, kinds=MESSAGE_KINDS),
                ReplicatedLog("actions", broker.pulllog, replica.histories["actions"],
                              broker.on_pulllog_thread, requires=("message",), snapshots=True),
            ], broker, self.role, self._heartbeat_soon)
        broker.on_commit = self.metrics.commit_batch_messages.observe
        broker.sends.answers_together = self.frames.answers_together()  # its one block
        broker.pulls.parked_answered = self._pull_answered
        # A round making held messages visible is a write: only by the leased, active master.
        broker.handoffs.role_refusal = lambda: self.role.refusal(boottime_ms())
        admin = BrokerAdmin(StorageAdmin(broker.store, broker.pulllog),
                            on_store_thread=broker.on_store_thread,
                            on_pulllog_thread=broker.on_pulllog_thread, clock=broker.clock)
        nacks = NackHandler(
            broker,
            RetryPolicies.from_settings(config.retry_backoff_ms, config.retries_max,
                                        config.retry_backoff_ms_by_group,
                                        config.retries_max_by_group),
            self._retry_sender.send if self._retry_sender else None,
            protect_dead_subject=admin.protect,
        )
        self._running = _Core(broker, nacks, admin)
        self.metrics.watch(broker, nacks)
        # Installed on the store's own thread, the only one that calls the store.
        await broker.on_store_thread(broker.store.observe_fsync,
                                     self.metrics.fsync_seconds.observe)
        tune_gc()  # after recovery, so gc.freeze moves the recovered state out of its way

    def _core(self) -> Broker:
        return self.broker

    async def _report(self) -> list[dict[str, Any]]:
        return self.nacks.annotate(await self.broker.backlog())

    def _begin_drain(self) -> None:
        if self._running is not None:
            self._running.broker.end_long_polls()

    async def _close_core(self) -> None:
        # The sends still waiting for their slaves' copy are refused (NotMaster) as the
        # replica stops (``ReplicaSource.stop``).
        if self.replica is not None:
            await self.replica.close()
        if self._running is not None:
            await self._running.broker.stop()
        if self._retry_sender is not None:
            await self._retry_sender.close()

    def handle_now(self, session: Session, request: Request, grant: Grant | None = None
                   ) -> dict[str, Any] | Later | Awaitable[dict[str, Any] | Later]:
        """Answer one data-plane request, after checking what the connection's token allows:
        at once when it can (no coroutine), else the awaitable that goes on with it
        (``ServerBase.handle_now``). ``grant`` is given only by ``_granted`` and
        ``_role_renewed``, which awaited for a request this call already counted."""
        core = self._running
        if core is None:
            core = self._started()  # raises: not started
        if grant is None:
            # Every op parse_request gives has its count (see RealtimeMetrics.request_counts).
            self._request_counts[request.op] += 1
            # Asked per request, not once per hello, so a revoked token stops within the cache
            # TTL; a fresh cached answer is one call and no coroutine.
            grant = self.gate.grant_now(session.token)
            if grant is None:
                return self._granted(session, request)  # asks the MetaServer, then here again
        # Told apart by their exact type (request types are never subclassed): no call.
        if type(request) is not Send:  # a send's subjects are checked below
            if type(request) is Pull or type(request) is Ack or type(request) is Nack:
                grant.check_consume(request.subject)
            elif type(request) is Heartbeat or type(request) is Leave:
                for subject, _group in request.subscriptions:
                    grant.check_consume(subject)
            elif type(request) is Subjects or type(request) is Browse or type(request) is Purge:
                grant.check_admin(request.op)
            elif type(request) is Hello:
                return self._hello()
            elif type(request) is Fetch or type(request) is Snapshot:
                return self._serve_replica(request, grant)
        # Only the leased master serves; it checks again before answering a write, so a write
        # whose commit outlived the lease is not acknowledged (docs/REPLICATION.md 5).
        if not self.role.writable_now():
            # A lapsed lease: renewed at once, then here again (or NotMaster).
            return self._role_renewed(session, request, grant)
        # A send, a pull, a heartbeat and an ack, most requests, are served right here, not
        # in ``_serve``: no coroutine for them while they do not wait (issue 18).
        if type(request) is Send:
            self.gate.check_send(grant, request.messages)
            # The broker's send path read directly, as ``_send_ended`` does: two Python calls
            # fewer a send (its ``readonly`` property and its ``send_soon`` pass-through).
            sends = core.broker.sends
            if sends.readonly and not sends.write_failed and self.registration is not None:
                return self._send_refreshed(core, request)
            sent = sends.send_soon(request.messages, request.compact, self._send_ended)
            if type(sent) is SendRequest:
                return sent  # its own Later: answered by _send_ended (the role checked then)
            answer: dict[str, Any] = {"results": sent}  # nothing valid to commit
        elif type(request) is Pull:
            # The pull path read directly, and its coroutine made only when it must suspend
            # (``Pulls.pull_now``): two calls fewer a pull (``Broker.pull``, ``Pulls.pull``).
            out = core.broker.pulls.pull_now(request, session)
            if type(out) is ParkedPull:
                return out  # its request's Later: _pull_answered answers it (the role then)
            if type(out) is not Pulled:
                return self._pulled(request, out)  # type: ignore[arg-type]
            answer = pull_response(*out)
        elif type(request) is Heartbeat:
            core.broker.heartbeat(request)
            answer = {"ok": True}
        elif type(request) is Ack:
            # The holdings read directly, and a coroutine made only when the ack must wait
            # (``Holdings.ack_now``): the pull-log thread busy, a trace read from the store,
            # a sync slave.
            acked = core.broker.holdings.ack_now(request)
            if type(acked) is not int:
                return self._acked(request, acked)  # type: ignore[arg-type]
            answer = {"acked": acked}
        else:
            return self._served(core, request, grant)
        if self.role.writable_now():  # the usual case, asked here: no _answerable call
            return answer
        return self._answerable(request, answer)

    async def _granted(self, session: Session, request: Request) -> dict[str, Any] | Later:
        """``handle_now`` for a request whose grant was not cached: asked, then served."""
        grant = await self.gate.grant(session.token, session.app)
        out = self.handle_now(session, request, grant)
        if type(out) is dict or type(out) in _LATER_TYPES:
            return out  # type: ignore[return-value]
        return await out  # type: ignore[misc]

    async def _role_renewed(self, session: Session, request: Request, grant: Grant
                            ) -> dict[str, Any] | Later:
        """``handle_now`` for a request that found the role refusing: the lease renewed at
        once (or NotMaster), then served (the access checks, pure, are asked again)."""
        await self._check_role_renewed()
        out = self.handle_now(session, request, grant)
        if type(out) is dict or type(out) in _LATER_TYPES:
            return out  # type: ignore[return-value]
        return await out  # type: ignore[misc]

    async def _send_refreshed(self, core: _Core, request: Send) -> dict[str, Any] | Later:
        """A send that found the broker read-only: the MetaServer's state asked first, then
        queued as ``handle_now`` queues it."""
        await self._refresh_before_send()
        sent = core.broker.sends.send_soon(request.messages, request.compact, self._send_ended)
        if type(sent) is SendRequest:
            return sent  # its own Later: answered by _send_ended (the role checked then)
        answer: dict[str, Any] = {"results": sent}  # nothing valid to commit
        if self.role.writable_now():
            return answer
        return self._answerable(request, answer)

    async def _pulled(self, request: Pull, pulling: Awaitable[Pulled | ParkedPull]
                      ) -> dict[str, Any] | Later:
        """A pull that must wait for the pull-log or store thread: its answer once read."""
        out = await pulling
        if type(out) is ParkedPull:
            return out
        answer = pull_response(*out)  # type: ignore[misc]
        if self.role.writable_now():
            return answer
        return self._answerable(request, answer)

    async def _acked(self, request: Ack, acking: Awaitable[int]) -> dict[str, Any]:
        """An ack that must wait (``Holdings.ack_now``'s coroutine): answered once recorded
        (and traced, and under ``sync`` replication copied), if the role allows then."""
        answer = {"acked": await acking}
        if self.role.writable_now():
            return answer
        return self._answerable(request, answer)

    async def _served(self, core: _Core, request: Request, grant: Grant) -> dict[str, Any]:
        """A request other than hello, a send, a pull, a heartbeat or an ack, served by
        ``_serve`` (the role checked again before its answer)."""
        answer = await self._serve(core, request, grant)
        if self.role.writable_now():
            return answer
        return self._answerable(request, answer)

    def _answerable(self, request: Request, answer: dict[str, Any]) -> dict[str, Any]:
        """``answer`` if the role still allows it to be given now, else raises NotMaster."""
        if self.role.writable_now():
            return answer
        if isinstance(request, Pull) and len(answer["payloads"]) \
                and self.role.only_lease_ran_out(boottime_ms()):
            # A pull that handed entries out is answered even if the lease ran out meanwhile
            # (a loaded machine stalls heartbeats for seconds): the entries are recorded as held
            # by this consumer, so a refusal would strand them until the ack timeout (60 s) on
            # a master that keeps its mastership; answered, the worst is a duplicate after a
            # failover, as for any pull not yet replicated (docs/REPLICATION.md 5). A master
            # handing over, demoted or stopping refuses as before.
            return answer
        self._check_role()  # raises: not writable now, and no await since
        return answer

    def _pull_answered(self, poll: ParkedPull, out: Pulled | BaseException) -> None:
        """A pull parked with no task ended (``Pulls.parked_answered``): its answer, written
        through the poll (its request's ``Later``) once the role allows it (as ``handle``
        checks it for an answer it returns)."""
        # ``Pulled`` is never subclassed: the usual outcome is told by its type, with no
        # isinstance call per woken pull (issue 18).
        if type(out) is not Pulled and isinstance(out, BaseException):
            poll.fail(out)
            return
        answer = pull_response(*out)
        if not self.role.writable_now():  # the usual case asked here: no _answerable call
            try:
                answer = self._answerable(poll.request, answer)
            except QmqError as exc:
                poll.fail(exc)
                return
        poll.answer(answer)

    def _send_ended(self, request: SendRequest) -> None:
        """A send's commit ended (stored or refused): answer it (the request is its own
        ``Later``), after the slaves under ``sync`` replication, and only while still the
        writable master (as ``handle``)."""
        try:
            # ``Sends.replicated_end``, read directly (the core read directly too, not
            # through ``broker``'s check): one call fewer a send's answer.
            end = request.log_end
            replica = self._running.broker.replica  # type: ignore[union-attr]
            if end and replica.replicating and not replica.replicated_now("message", end):
                # A slave in sync is behind: answered by the fetch that reports its copy (or
                # refused), with no coroutine or task.
                replica.park_replicated("message", end, partial(self._send_replicated, request))
                return
            # ``_answer_sent``, inline for the usual answer (two calls fewer a send).
            if request.compact:  # ``Sends.outcome``
                answer = send_stored_answer(len(request.results))
            else:
                answer = {"results": request.results}
            if not self.role.writable_now():
                self._check_role()  # raises: a write that outlived the lease is not answered
        except Exception as exc:  # NotMaster, or a server bug: answered internal and logged
            request.fail(exc)
            return
        request.answer(answer)

    def _send_replicated(self, request: SendRequest, error: BaseException | None) -> None:
        """A send's wait for its slaves ended (``park_replicated``): answered, or refused."""
        if error is not None:  # NotMaster: this server stopped being master meanwhile
            request.fail(error)
            return
        try:
            self._answer_sent(request)
        except Exception as exc:  # a server bug: answered internal and logged
            request.fail(exc)

    def _answer_sent(self, request: SendRequest) -> None:
        """Answer a send whose commit (and the slaves' copy) ended, if the role allows."""
        outcome = Sends.outcome(request)
        answer = (send_stored_answer(outcome) if type(outcome) is int
                  else {"results": outcome})
        if not self.role.writable_now():
            try:
                self._check_role()  # raises: a write that outlived the lease is not answered
            except QmqError as exc:
                request.fail(exc)
                return
        request.answer(answer)

    async def _refresh_before_send(self) -> None:
        """A send reached a read-only broker: the MetaServer may have switched us back to rw
        since our last heartbeat; ask (rate-limited) rather than refuse a producer it already
        routes here. NotMaster if demoted meanwhile."""
        await asyncio.sleep(0)  # stepped inline: the MetaServer call needs a task
        await self.registration.refresh_state()  # type: ignore[union-attr]
        if not self.role.writable_now():
            # Demoted while it asked: nothing is written to what is now a copy.
            self._check_role()  # raises NotMaster, saying why

    async def _serve(self, core: _Core, request: Request, grant: Grant) -> dict[str, Any]:
        """Answer one request other than hello, a send, a pull, a heartbeat or an ack (the
        role was checked)."""
        broker = core.broker
        if type(request) is Leave:
            return {"released": await broker.leave(request)}
        if type(request) is Nack:
            return {"nacked": await core.nacks.nack(request)}
        if type(request) is Hold:
            self.gate.check_send(grant, request.messages)
            now_ms = broker.clock()  # as it arrived: the delay server bounds clock skew by it
            return {"results": await broker.hold(request.messages, request.visible_at_ms),
                    "now_ms": now_ms}
        if type(request) is CancelHeld:
            if not grant.admin:
                grant.check_produce(request.subject)
            cancelled, before = await broker.cancel_held(request.subject, request.ids)
            return {"cancelled": cancelled, "dropped_before": before}
        if type(request) is Cancel:
            raise NotSupported("cancel is answered by delay servers, not realtime servers")
        if type(request) is Subjects or type(request) is Browse or type(request) is Purge:
            return await core.admin.answer(request)
        raise NotSupported(f"op {request.op} is not served by realtime servers")


__all__ = ["RealtimeServer"]
