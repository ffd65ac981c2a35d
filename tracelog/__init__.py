"""Trace events: the schema, the line encoder and the writer the servers append with
(``events``), and the trace view of a payload (``peek``). ``spark_audit`` reads what they write.

``events`` imports nothing of ours, so the audit can load the schema without any server code;
``peek`` imports ``wire``.
"""
