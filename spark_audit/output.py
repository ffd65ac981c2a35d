"""Getting the audit's small results to the driver and its outputs to storage, in few Spark jobs.

Every Spark action costs a job (planning, scheduling, tasks, a commit); on a small trace those
fixed costs are most of the audit's time. So:

- ``collect_tables`` computes every small result in ONE job: each table's rows as JSON strings,
  tagged with the table's name, in one union (Spark runs the independent stages side by side),
  parsed back on the driver into rows of the table's own schema.
- ``write_tables`` writes them, each as one Parquet file of its own directory, from a few
  driver threads at once (Spark runs concurrent jobs; each of these is a single small task and
  a commit), beside any other write passed in (the anomalies with their histories). A table
  goes back to Spark as ONE string literal, its rows' JSON, parsed by ``from_json`` in the JVM:
  ``createDataFrame`` of Python rows would start Python workers (a process per executor, and
  Python on every executor of a cluster) to unpickle them.
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
from pyspark.sql.types import ArrayType, StructType

WRITE_THREADS = 4  # concurrent Parquet writes (each a one-task job)
# A table whose rows' JSON is larger than this goes back to Spark through createDataFrame
# rather than as one literal in the plan (never the case for the audit's small tables).
LITERAL_TABLE_CHARS_MAX = 16 << 20


class Table:
    """A small result collected on the driver: its schema, its rows (sorted) and each row as
    the JSON ``to_json`` gave (to write it back without Python workers)."""

    def __init__(self, schema: StructType, rows: list[tuple],
                 json_rows: list[str] | None = None) -> None:
        self.schema = schema
        self.rows = rows
        self.json_rows = json_rows

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
    rows: dict[str, list[tuple[tuple, str]]] = {name: [] for name in tables}
    fields = {name: df.schema.fieldNames() for name, (df, _order) in tables.items()}
    for found in reduce(DataFrame.union, parts).collect():
        text = found["_row"]
        parsed = json.loads(text)  # to_json leaves null fields out
        rows[found["_table"]].append((tuple(parsed.get(c) for c in fields[found["_table"]]),
                                      text))
    out = {}
    for name, (df, order) in tables.items():
        key = _sort_key([fields[name].index(c) for c in order])
        ordered = sorted(rows[name], key=lambda pair: key(pair[0]))
        out[name] = Table(df.schema, [row for row, _ in ordered], [text for _, text in ordered])
    return out


def table_frame(spark: SparkSession, table: Table) -> DataFrame:
    """The table as a DataFrame of its schema, in its order, built in the JVM from its rows'
    JSON (one literal), so no Python worker starts; createDataFrame when there is no JSON or
    it is too large to be a literal."""
    text = None if table.json_rows is None else "[" + ",".join(table.json_rows) + "]"
    if text is None or len(text) > LITERAL_TABLE_CHARS_MAX:
        return spark.createDataFrame(table.rows, table.schema)
    parsed = F.from_json(F.lit(text), ArrayType(table.schema))
    return spark.range(1).select(F.explode(parsed).alias("_row")).select(
        *[F.col("_row")[c].alias(c) for c in table.schema.fieldNames()])


def write_tables(spark: SparkSession, out_dir: str, tables: Mapping[str, Table],
                 *others: Callable[[], None]) -> None:
    """Write each table as ``<out_dir>/<name>/`` (one Parquet file, overwritten), and run the
    ``others`` (more writes), all from WRITE_THREADS driver threads at once."""
    base = out_dir.rstrip("/")

    def write(name: str, table: Table) -> None:
        table_frame(spark, table).coalesce(1).write.mode("overwrite").parquet(f"{base}/{name}")

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
