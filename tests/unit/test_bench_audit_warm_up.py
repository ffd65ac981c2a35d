"""bench.audit's warm-up: untimed audits until the class archive and its top layer are built."""

from __future__ import annotations

import argparse

import bench.audit as bench_audit
from spark_audit import class_archive
from spark_audit.class_archive import ClassArchive


def test_the_warm_up_records_the_class_list_then_the_top_layer_then_stops(tmp_path,
                                                                           monkeypatch):
    archive = ClassArchive(str(tmp_path), "k", "unused")
    built: list[str] = []

    def fake_audit(trace, out, args):  # the detached builder's work, done at once
        path = archive.top_path if archive.ready() else archive.archive_path
        with open(path, "w") as file:
            file.write("built")
        built.append(path)
        return 1.0, 1.0, "PASS"

    monkeypatch.setattr(class_archive, "plan", lambda directory: archive)
    monkeypatch.setattr(bench_audit, "audit_once", fake_audit)
    args = argparse.Namespace(class_archive_dir=str(tmp_path))
    bench_audit.warm_up("trace", "out", args)
    assert built == [archive.archive_path, archive.top_path]
    bench_audit.warm_up("trace", "out", args)  # both built: no audit
    assert len(built) == 2
