"""Getting the audit's small results to the driver and its outputs to storage, in few Spark jobs.

Every Spark action costs a job (planning, scheduling, tasks, a commit); on a small trace those
fixed costs are most of the audit's time. So:

- ``collect_tables`` computes every small result in ONE job: each table's rows as JSON strings,
  tagged with the table's name, in one union (Spark runs the independent stages side by side),
  parsed back on the driver into rows of the table's own schema.
- ``write_table`` writes a collected table from the driver, with no Spark job at all: pyarrow
  encodes it as one Parquet file in memory (the table's Spark schema as Arrow's) and
  ``write_bytes`` stores it as ``<dir>/part-00000.parquet`` beside an empty ``_SUCCESS``, what
  a Spark write of one partition leaves. A Spark write of each small table cost a job, a
  commit protocol and, on a local disk, a ``chmod`` process per file and directory (Hadoop's
  local file system without its native library): about 10 CPU-s of a 10k-event audit's 40.
- ``write_bytes`` and ``write_text`` write a local path (or ``file:``) with Python's own file
  calls, and any other URI through Hadoop's FileSystem, so ``--out`` may be HDFS, S3 or local.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import reduce
from typing import Any

from pyspark.sql import DataFrame, Row, SparkSession
from pyspark.sql.types import ArrayType, DataType, StructType

from spark_audit.load import is_local, local_path

PART_FILE_NAME = "part-00000.parquet"  # a table written from the driver: one file


class Table:
    """A small result collected on the driver: its schema and its rows (sorted)."""

    def __init__(self, schema: StructType, rows: list[tuple]) -> None:
        self.schema = schema
        self.rows = rows

    def dicts(self) -> list[dict]:
        """The rows as dicts, for the reports."""
        names = self.schema.fieldNames()
        return [dict(zip(names, row)) for row in self.rows]


def _sort_key(order: Sequence[int]) -> Callable[[tuple], tuple]:
    return lambda row: tuple((row[i] is None, row[i]) for i in order)


def _from_json(value: Any, data_type: DataType) -> Any:
    """A value parsed from ``to_json`` in the shape ``Row.asDict(recursive=True)`` gives: every
    field of a struct present (``to_json`` leaves null fields out), nested ones too."""
    if value is None:
        return None
    if isinstance(data_type, StructType):
        return {field.name: _from_json(value.get(field.name), field.dataType)
                for field in data_type.fields}
    if isinstance(data_type, ArrayType):
        return [_from_json(item, data_type.elementType) for item in value]
    return value


def _table_name(name: str) -> str:
    """``name``, checked to be safe inside a SQL string literal."""
    if not name.isidentifier():
        raise ValueError(f"table name {name!r} is not an identifier")
    return name


def collect_tables(tables: Mapping[str, tuple[DataFrame, Sequence[str]]]) -> dict[str, Table]:
    """``{name: (small DataFrame, columns to sort by)}`` -> ``{name: Table}``, in one job."""
    if not tables:
        return {}
    # One SQL expression list per table: built from Column objects, these took about 480 py4j
    # round trips (a column reference per field) of a 10k-event audit's ~5,600.
    parts = [df.selectExpr(f"'{_table_name(name)}' AS _table", "to_json(struct(*)) AS _row")
             for name, (df, _order) in tables.items()]
    rows: dict[str, list[tuple]] = {name: [] for name in tables}
    schemas = {name: df.schema for name, (df, _order) in tables.items()}
    for found in reduce(DataFrame.union, parts).collect():
        name = found["_table"]
        parsed = json.loads(found["_row"])
        rows[name].append(tuple(_from_json(parsed.get(field.name), field.dataType)
                                for field in schemas[name].fields))
    out = {}
    for name, (_df, order) in tables.items():
        key = _sort_key([schemas[name].fieldNames().index(c) for c in order])
        out[name] = Table(schemas[name], sorted(rows[name], key=key))
    return out


def _hadoop_fs(spark: SparkSession, uri: str) -> tuple[Any, Any]:
    jvm = spark.sparkContext._jvm
    path = jvm.org.apache.hadoop.fs.Path(uri)
    return path.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration()), path


def remove_tree(spark: SparkSession, uri: str) -> None:
    """Delete ``uri`` and everything under it, if it exists (a write's "overwrite")."""
    if is_local(uri):
        shutil.rmtree(local_path(uri), ignore_errors=True)
        return
    fs, path = _hadoop_fs(spark, uri)
    fs.delete(path, True)


def write_bytes(spark: SparkSession, uri: str, data: bytes) -> None:
    """Write ``data`` to the file ``uri`` (its parent directories created, an older file
    replaced): local paths with Python's file calls, any other URI through Hadoop's FileSystem."""
    if is_local(uri):
        path = local_path(uri)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "wb") as file:
            file.write(data)
        return
    fs, path = _hadoop_fs(spark, uri)
    stream = fs.create(path, True)
    try:
        stream.write(bytearray(data))
    finally:
        stream.close()


def write_text(spark: SparkSession, uri: str, text: str) -> None:
    """Write ``text`` (UTF-8) to ``uri`` (``write_bytes``): --out may be HDFS/S3 or local."""
    write_bytes(spark, uri, text.encode("utf-8"))


def parquet_bytes(table: Table) -> bytes:
    """The table as one Parquet file (pyarrow, snappy as Spark writes it), its columns typed as
    the table's Spark schema reads back."""
    import pyarrow as pa  # lazily: only the driver of an audit needs it
    import pyarrow.parquet as pq
    from pyspark.sql.pandas.types import to_arrow_schema

    schema = to_arrow_schema(table.schema)
    columns = list(zip(*table.rows)) if table.rows else [() for _ in schema]
    arrays = [pa.array(list(values), type=field.type) for values, field in zip(columns, schema)]
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_arrays(arrays, schema=schema), sink, compression="snappy")
    return sink.getvalue().to_pybytes()


def write_table(spark: SparkSession, uri: str, table: Table) -> None:
    """Replace the directory ``uri`` with the table as one Parquet file and ``_SUCCESS``, from
    the driver (no Spark job)."""
    data = parquet_bytes(table)
    base = uri.rstrip("/")
    remove_tree(spark, base)
    write_bytes(spark, f"{base}/{PART_FILE_NAME}", data)
    write_bytes(spark, f"{base}/_SUCCESS", b"")


def write_tables(spark: SparkSession, out_dir: str, tables: Mapping[str, Table],
                 *others: Callable[[], None]) -> None:
    """Write each table as ``<out_dir>/<name>/`` (``write_table``) while the ``others`` (Spark
    writes, each on a driver thread of its own) run."""
    base = out_dir.rstrip("/")
    with ThreadPoolExecutor(max(1, len(others)), thread_name_prefix="audit-write") as pool:
        futures = [pool.submit(other) for other in others]
        for name, table in tables.items():
            write_table(spark, f"{base}/{name}", table)
        for future in futures:
            future.result()


def rows_as_dicts(rows: Sequence[Row]) -> list[dict]:
    """Collected rows as plain dicts (nested rows too)."""
    return [row.asDict(recursive=True) for row in rows]
