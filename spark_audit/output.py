"""Getting the audit's small results to the driver and its outputs to storage, in few Spark jobs.

Every Spark action costs a job (planning, scheduling, tasks, a commit); on a small trace those
fixed costs are most of the audit's time. So:

- ``collect_tables`` computes every small result in ONE job: each table's rows as JSON strings,
  tagged with the table's name, in one union (Spark runs the independent stages side by side),
  parsed back on the driver into rows of the table's own schema.
- ``write_tables`` writes them, each as one Parquet file of its own directory, from a few
  driver threads at once (Spark runs concurrent jobs; each of these is a single small task and
  a commit), beside any other write passed in (the anomalies with their histories).
- ``write_text`` writes report files through Hadoop's FileSystem, so ``--out`` may be HDFS, S3
  or local.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import reduce

from pyspark.sql import DataFrame, Row, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

WRITE_THREADS = 4  # concurrent Parquet writes (each a one-task job)


class Table:
    """A small result collected on the driver: its schema and its rows, sorted."""

    def __init__(self, schema: StructType, rows: list[tuple]) -> None:
        self.schema = schema
        self.rows = rows

    def dicts(self) -> list[dict]:
        """The rows as dicts, for the reports."""
        names = self.schema.fieldNames()
        return [dict(zip(names, row)) for row in self.rows]


def _sort_key(order: Sequence[int]) -> Callable[[tuple], tuple]:
    return lambda row: tuple((row[i] is None, row[i]) for i in order)


def collect_tables(tables: Mapping[str, tuple[DataFrame, Sequence[str]]]) -> dict[str, Table]:
    """``{name: (small DataFrame, columns to sort by)}`` -> ``{name: Table}``, in one job."""
    if not tables:
        return {}
    parts = [df.select(F.lit(name).alias("_table"),
                       F.to_json(F.struct(*[F.col(c) for c in df.columns])).alias("_row"))
             for name, (df, _order) in tables.items()]
    rows: dict[str, list[tuple]] = {name: [] for name in tables}
    fields = {name: df.schema.fieldNames() for name, (df, _order) in tables.items()}
    for found in reduce(DataFrame.union, parts).collect():
        parsed = json.loads(found["_row"])  # to_json leaves null fields out
        rows[found["_table"]].append(tuple(parsed.get(c) for c in fields[found["_table"]]))
    out = {}
    for name, (df, order) in tables.items():
        positions = [fields[name].index(c) for c in order]
        out[name] = Table(df.schema, sorted(rows[name], key=_sort_key(positions)))
    return out


def write_tables(spark: SparkSession, out_dir: str, tables: Mapping[str, Table],
                 *others: Callable[[], None]) -> None:
    """Write each table as ``<out_dir>/<name>/`` (one Parquet file, overwritten), and run the
    ``others`` (more writes), all from WRITE_THREADS driver threads at once."""
    base = out_dir.rstrip("/")

    def write(name: str, table: Table) -> None:
        spark.createDataFrame(table.rows, table.schema).coalesce(1).write.mode(
            "overwrite").parquet(f"{base}/{name}")

    with ThreadPoolExecutor(WRITE_THREADS, thread_name_prefix="audit-write") as pool:
        futures = [pool.submit(other) for other in others]
        futures += [pool.submit(write, name, table) for name, table in tables.items()]
        for future in futures:
            future.result()


def write_text(spark: SparkSession, uri: str, text: str) -> None:
    """Write ``text`` to ``uri`` through Hadoop's FileSystem, so --out may be HDFS/S3 or local."""
    jvm = spark.sparkContext._jvm
    path = jvm.org.apache.hadoop.fs.Path(uri)
    stream = path.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration()).create(path, True)
    try:
        stream.write(bytearray(text.encode("utf-8")))
    finally:
        stream.close()


def rows_as_dicts(rows: Sequence[Row]) -> list[dict]:
    """Collected rows as plain dicts (nested rows too)."""
    return [row.asDict(recursive=True) for row in rows]
