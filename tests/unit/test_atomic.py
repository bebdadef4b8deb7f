"""Durable atomic writes: the temp file is fsynced before the rename, its directory after (issue 10)."""

import os
from pathlib import Path

import pytest

from ethpipe import atomic
from ethpipe.atomic import atomic_path, write_bytes_atomic, write_text_atomic


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Every fsync (by the path its descriptor names) and rename, in order."""
    log: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        log.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: str | Path, dst: str | Path) -> None:
        log.append(("replace", str(dst)))
        real_replace(src, dst)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return log


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to name descriptors")
def test_file_fsynced_before_rename_and_directory_after(tmp_path: Path, events: list[tuple[str, str]]) -> None:
    out = tmp_path / "sub" / "plan.json"
    write_text_atomic(out, "{}\n")
    assert out.read_text() == "{}\n"
    (kind0, tmp_name), (kind1, dst), (kind2, directory) = events
    assert kind0 == "fsync" and Path(tmp_name).parent == out.parent and Path(tmp_name).name.startswith(".plan.json.")
    assert (kind1, dst) == ("replace", str(out))
    assert (kind2, directory) == ("fsync", str(out.parent.resolve()))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to name descriptors")
def test_tmp_prefix_names_the_temp_file(tmp_path: Path, events: list[tuple[str, str]]) -> None:
    write_bytes_atomic(tmp_path / "latest", b"step-1\n", tmp_prefix=".tmp-latest.")
    assert Path(events[0][1]).name.startswith(".tmp-latest.")


def test_checkpoint_manifest_writes_are_durable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ethpipe.runtime.checkpoint import layout as ckpt_layout

    synced: list[str] = []
    real_fsync_path = atomic.fsync_path
    monkeypatch.setattr(atomic, "fsync_path", lambda p: (synced.append(str(p)), real_fsync_path(p)))
    ckpt_layout._write_durable(tmp_path / "latest", "step-00000001\n")
    assert (tmp_path / "latest").read_text() == "step-00000001\n"
    assert Path(synced[0]).name.startswith(ckpt_layout.TMP_PREFIX) and synced[1] == str(tmp_path)


def test_failure_before_rename_leaves_old_file_and_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "tokens.bin"
    out.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="writer died"), atomic_path(out) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("writer died")

    def no_disk(fd: int) -> None:
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(os, "fsync", no_disk)
    with pytest.raises(OSError, match="Input/output error"):
        write_bytes_atomic(out, b"new payload")
    assert out.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["tokens.bin"]
