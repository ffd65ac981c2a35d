"""Trace events: the schema, the line encoder and the writer the servers append with
(``events``), and the trace view of a payload (``peek``). ``spark_audit`` reads what they write.

``events`` imports only ``wire.clock`` (a module of the standard library's ``time`` alone), so
the audit can load the schema without any server or client code; ``peek`` imports
``wire.message``.
"""
