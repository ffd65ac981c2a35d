"""spark_audit.output: small tables collected in one job and written by the driver."""

from __future__ import annotations

from pyspark.sql import functions as F
from pyspark.testing import assertDataFrameEqual

from spark_audit.output import PART_FILE_NAME, Table, collect_tables, write_table

SCHEMA = ("kind string, n long, small int, ok boolean, tags array<string>, "
          "history array<struct<ts_ms:long,event:string,group:string>>")
ROWS = [
    ("lost", 2, 7, True, ["a", "b"], [(1, "produced", None), (2, "pulled", "g")]),
    ("dead", None, None, None, None, None),
    ("early", 1, 0, False, [], []),
]


def test_a_table_written_by_the_driver_reads_back_in_spark_as_it_was_collected(spark, tmp_path):
    frame = spark.createDataFrame(ROWS, SCHEMA)
    table = collect_tables({"t": (frame, ["kind"])})["t"]
    # Nested structs come back whole (to_json leaves null fields out), as asDict gives them.
    assert table.dicts()[2]["history"] == [{"ts_ms": 1, "event": "produced", "group": None},
                                           {"ts_ms": 2, "event": "pulled", "group": "g"}]
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "stale.parquet").write_bytes(b"an older output, replaced")

    write_table(spark, str(tmp_path / "t"), table)

    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == ["_SUCCESS", PART_FILE_NAME]
    back = spark.read.parquet(str(tmp_path / "t"))
    assert back.schema.simpleString() == frame.schema.simpleString()
    assertDataFrameEqual(back, frame)


def test_an_empty_table_is_written_with_its_columns(spark, tmp_path):
    frame = spark.createDataFrame(ROWS, SCHEMA).where(F.lit(False))

    write_table(spark, f"file://{tmp_path}/empty", Table(frame.schema, []))

    back = spark.read.parquet(str(tmp_path / "empty"))
    assert back.schema.simpleString() == frame.schema.simpleString()
    assert back.count() == 0


def test_a_table_name_that_could_break_out_of_its_sql_literal_is_refused(spark):
    import pytest

    frame = spark.range(1)
    with pytest.raises(ValueError, match="not an identifier"):
        collect_tables({"t' AS _table, 'x": (frame, ["id"])})


def test_tables_with_nested_and_null_fields_come_back_as_spark_collects_them(spark):
    frame = spark.createDataFrame(
        [("a", None, [1, 2], ("x", None)), ("b", 3, None, None)],
        "name string, n int, xs array<int>, s struct<k:string,v:bigint>")
    table = collect_tables({"t": (frame, ["name"])})["t"]
    assert table.schema == frame.schema
    assert table.dicts() == [row.asDict(recursive=True) for row in frame.orderBy("name").collect()]
