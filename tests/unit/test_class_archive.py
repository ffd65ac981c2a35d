"""spark_audit.class_archive: the driver JVM's class-data-sharing archive, recorded by one audit,
dumped by a detached builder under a lock, renamed into place, used by later audits."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys

from spark_audit.class_archive import (
    ClassArchive,
    archive_key,
    build,
    dump_command,
    dump_options,
    plan,
)

# Stands in for java -Xshare:dump: writes the archive it is asked for (or fails if told to);
# and for java -Xshare:on ... -version, the check of a top layer (fails if told to).
FAKE_JAVA = """#!/bin/sh
for arg in "$@"; do
  [ "$arg" = -version ] && { [ -n "$FAIL_CHECK" ] && { echo "bad top" >&2; exit 1; }; exit 0; }
done
[ -n "$FAIL_DUMP" ] && { echo "dump failed" >&2; exit 1; }
for arg in "$@"; do
  case "$arg" in -XX:SharedArchiveFile=*) echo archive > "${arg#-XX:SharedArchiveFile=}";; esac
done
"""


def _exited_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _recording(tmp_path, archive: ClassArchive, pid: int) -> str:
    java = tmp_path / "java"
    java.write_text(FAKE_JAVA)
    java.chmod(0o755)
    list_path = archive.list_path(pid)
    with open(list_path, "w") as file:
        file.write("java/lang/Object id: 0\n")
    recording = {"archive_dir": archive.directory, "key": archive.key, "java": str(java),
                 "class_list": list_path, "class_path": "/spark/conf:/spark/jars/a.jar",
                 "options": ["-XX:+UseSerialGC"], "jvm_pid": _exited_pid()}
    path = list_path + ".json"
    with open(path, "w") as file:
        json.dump(recording, file)
    return path


def test_an_audit_records_its_class_list_until_the_archive_is_built_then_uses_it(tmp_path):
    archive = ClassArchive(str(tmp_path), "k", "/usr/bin/java")
    options, recording = archive.java_options(41)
    assert recording and f"-XX:DumpLoadedClassList={tmp_path}/k.classes-41.lst" in options
    (tmp_path / "k.jsa").write_text("archive")
    options, recording = archive.java_options(41)
    assert f"-XX:SharedArchiveFile={tmp_path}/k.jsa" in options
    assert "DumpLoadedClassList" not in options  # (it records the top layer next: below)
    # JVM warnings (an archive that does not match) must not reach qmq audit --json's stdout
    assert "-Xlog:disable -Xlog:all=warning:stderr" in options


def _top_recording(tmp_path, archive: ClassArchive, pid: int, written: bool = True) -> str:
    """A recording of an audit whose JVM wrote (or not) the top layer at its exit."""
    path = _recording(tmp_path, archive, pid)
    with open(path) as file:
        facts = json.load(file)
    os.remove(path)
    os.remove(facts["class_list"])
    facts["top"] = archive.top_tmp_path(pid)
    if written:
        with open(facts["top"], "w") as file:
            file.write("top")
    path = facts["top"] + ".json"
    with open(path, "w") as file:
        json.dump(facts, file)
    return path


def test_once_the_archive_is_built_one_audit_records_its_top_layer_then_audits_use_both(
        tmp_path):
    archive = ClassArchive(str(tmp_path), "k", "/usr/bin/java")
    (tmp_path / "k.jsa").write_text("archive")
    options, recording = archive.java_options(41)
    assert recording and f"-XX:SharedArchiveFile={tmp_path}/k.jsa " in options
    assert f"-XX:ArchiveClassesAtExit={tmp_path}/k.top.tmp-41.jsa" in options
    # its exit's warnings about classes no archive takes come after qmq audit has returned
    assert options.endswith("-Xlog:all=warning:stderr -Xlog:cds*=off:stderr")
    (tmp_path / "k.top.jsa").write_text("top")
    options, recording = archive.java_options(41)
    assert not recording and "ArchiveClassesAtExit" not in options
    assert f"-XX:SharedArchiveFile={tmp_path}/k.jsa:{tmp_path}/k.top.jsa" in options


def test_the_builder_checks_the_top_layer_and_renames_it_into_place(tmp_path):
    archive = ClassArchive(str(tmp_path), "k", "unused")
    (tmp_path / "k.jsa").write_text("archive")
    assert build(_top_recording(tmp_path, archive, 7), jvm_exit_wait_s=60) == "built"
    assert (tmp_path / "k.top.jsa").read_text() == "top"
    assert sorted(os.listdir(tmp_path)) == ["java", "k.jsa", "k.lock", "k.top.jsa"]
    # a second recording (two audits at once) is dropped, its layer removed
    assert build(_top_recording(tmp_path, archive, 8), jvm_exit_wait_s=60) == "exists"
    assert sorted(os.listdir(tmp_path)) == ["java", "k.jsa", "k.lock", "k.top.jsa"]


def test_a_top_layer_no_jvm_opens_or_none_written_is_remembered_and_never_used(
        tmp_path, monkeypatch):
    archive = ClassArchive(str(tmp_path), "k", "unused")
    (tmp_path / "k.jsa").write_text("archive")
    monkeypatch.setenv("FAIL_CHECK", "1")
    assert build(_top_recording(tmp_path, archive, 7), jvm_exit_wait_s=60) == "failed"
    assert "bad top" in (tmp_path / "k.top.failed").read_text()
    options, recording = archive.java_options(9)
    assert not recording and f"-XX:SharedArchiveFile={tmp_path}/k.jsa " in options
    assert "ArchiveClassesAtExit" not in options and "k.top" not in options
    assert sorted(os.listdir(tmp_path)) == ["java", "k.jsa", "k.lock", "k.top.failed"]
    monkeypatch.delenv("FAIL_CHECK")
    os.remove(tmp_path / "k.top.failed")
    assert build(_top_recording(tmp_path, archive, 8, written=False),
                 jvm_exit_wait_s=60) == "failed"
    assert "wrote no top layer" in (tmp_path / "k.top.failed").read_text()


def test_the_builder_dumps_into_a_temporary_file_and_renames_it_into_place(tmp_path):
    archive = ClassArchive(str(tmp_path), "k", "unused")
    recording = _recording(tmp_path, archive, 7)
    assert build(recording, jvm_exit_wait_s=60) == "built"
    assert (tmp_path / "k.jsa").read_text() == "archive\n"
    # the list and the recording are removed; no temporary file is left
    assert sorted(os.listdir(tmp_path)) == ["java", "k.jsa", "k.lock"]
    assert build(_recording(tmp_path, archive, 8), jvm_exit_wait_s=60) == "exists"


def test_a_second_builder_gives_up_while_one_holds_the_lock(tmp_path):
    archive = ClassArchive(str(tmp_path), "k", "unused")
    recording = _recording(tmp_path, archive, 7)
    with open(archive.lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        assert build(recording, jvm_exit_wait_s=60) == "busy"
    assert not (tmp_path / "k.jsa").exists() and not (tmp_path / "k.classes-7.lst").exists()


def test_a_failed_dump_is_remembered_so_no_later_audit_records_or_builds_again(
        tmp_path, monkeypatch):
    archive = ClassArchive(str(tmp_path), "k", "unused")
    monkeypatch.setenv("FAIL_DUMP", "1")
    assert build(_recording(tmp_path, archive, 7), jvm_exit_wait_s=60) == "failed"
    assert "dump failed" in (tmp_path / "k.failed").read_text()
    assert archive.java_options(9)[1] is False
    assert not any(name.startswith("k.jsa") for name in os.listdir(tmp_path))


def test_the_builder_waits_for_the_recording_jvm_to_exit(tmp_path):
    archive = ClassArchive(str(tmp_path), "k", "unused")
    recording = _recording(tmp_path, archive, 7)
    with open(recording) as file:
        facts = json.load(file)
    facts["jvm_pid"] = os.getpid()  # still running
    with open(recording, "w") as file:
        json.dump(facts, file)
    assert build(recording, jvm_exit_wait_s=0) == "jvm running"
    assert not (tmp_path / "k.jsa").exists()


def test_the_dump_repeats_the_recording_jvms_class_path_modules_and_gc():
    assert dump_options(["-Xmx6g", "--add-opens=java.base/java.lang=ALL-UNNAMED",
                         "-XX:+IgnoreUnrecognizedVMOptions", "-XX:+UseSerialGC",
                         "-XX:TieredStopAtLevel=1", "-XX:DumpLoadedClassList=/x.lst"]) == [
        "--add-opens=java.base/java.lang=ALL-UNNAMED", "-XX:+IgnoreUnrecognizedVMOptions",
        "-XX:+UseSerialGC"]
    recording = {"java": "/j/java", "options": ["-XX:+UseSerialGC"], "class_list": "/c/k.lst",
                 "class_path": "/s/conf:/s/jars/a.jar"}
    assert dump_command(recording, "/c/k.jsa.tmp-1") == [
        "/j/java", "-Xshare:dump", "-XX:+UseSerialGC", "-XX:SharedClassListFile=/c/k.lst",
        "-XX:SharedArchiveFile=/c/k.jsa.tmp-1", "-cp", "/s/conf:/s/jars/a.jar"]


def test_the_key_changes_with_the_jars_and_the_archive_can_be_turned_off(tmp_path):
    java = tmp_path / "java"
    java.write_text("")
    (tmp_path / "jars").mkdir()
    (tmp_path / "jars" / "a.jar").write_text("a")
    before = archive_key(str(java), str(tmp_path), "4.3.0")
    (tmp_path / "jars" / "b.jar").write_text("b")
    assert archive_key(str(java), str(tmp_path), "4.3.0") != before
    assert archive_key(str(java), str(tmp_path), "4.3.1").startswith("pyspark-4.3.1-")
    other_home = tmp_path / "venv2"
    (other_home / "jars").mkdir(parents=True)
    for name in ("a.jar", "b.jar"):
        (other_home / "jars" / name).write_text(name[0])
    # the same jars in another virtualenv: another class path, so another archive
    assert archive_key(str(java), str(other_home), "4.3.0") != archive_key(
        str(java), str(tmp_path), "4.3.0")
    assert plan("off") is None and plan(None) is None and plan(str(tmp_path / "a b")) is None
