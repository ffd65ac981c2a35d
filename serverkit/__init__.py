"""What every server shares and no client needs: the frame server (``frame_server``), MetaServer
registration and heartbeats (``registration``), the access gate and its cache of token checks
(``access``), the ``/metrics`` listener (``metrics_http``), forwarding payloads to a subject's
brokers (``payload_sender``), the quick check of a sent batch (``send_check``, with its optional C
twin ``_send_check``), the I/O thread a synchronous store runs on (``io_thread``), the group
commit of sends with the triage of a failed commit (``committer``), the settings every server
has (``config``), the start-up and shutdown both servers share around their core (``server``)
and a background round run at an interval (``periodic``).

It imports ``wire`` and ``tracelog``, ``sdk`` for the client connection and route cache that a
server uses when it calls another server, and ``logstore`` for the storage errors the committer
triages; never a server package.
"""
