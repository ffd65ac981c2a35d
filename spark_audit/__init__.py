"""PySpark audit jobs over the trace events (not built yet: issue "Trace events and the Spark audit").

Will hold pure DataFrame -> DataFrame transforms and thin ``main()`` functions. Nothing here works yet.
"""
