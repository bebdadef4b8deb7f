"""The shared-filesystem check of checkpoints, without a process group (the collective: tests/dist)."""

from pathlib import Path

from ethpipe.errors import UserError
from ethpipe.runtime.checkpoint.shared_fs import _visible, blind_error, missing, writer_of

HINT = "use a shared filesystem (NFS, Lustre, ...) for --checkpoint-dir"


def test_every_rank_seeing_what_it_looks_for_passes() -> None:
    assert blind_error("/ckpt", [(0, []), (1, []), (2, [])]) is None


def test_node_local_disks_name_the_first_blind_rank_and_the_writer() -> None:
    # Ranks 0-1 on node A (rank 0 also wrote .metadata), ranks 2-3 on node B: rank 0 misses B's shards.
    err = blind_error("/local/ckpt", [(0, ["__3_0.distcp", "__2_0.distcp"]), (2, [".metadata"])])
    assert str(err) == ("checkpoint dir '/local/ckpt' is not on a filesystem shared by all ranks: rank 0 cannot see "
                        f"rank 2's file '__2_0.distcp' and 1 more; {HINT}")
    assert isinstance(err, UserError)
    err = blind_error("/ckpt", [(0, []), (3, [".metadata"])])
    assert "rank 3 cannot see rank 0's file '.metadata';" in str(err)


def test_writers_are_as_reported_else_read_from_dcps_shard_names() -> None:
    assert writer_of("__7_0.distcp") == 7 and writer_of(".metadata") == 0
    assert writer_of("custom.bin", {"custom.bin": 5}) == 5
    err = blind_error("/ckpt", [(0, ["custom.bin"])], {"custom.bin": 5})
    assert "rank 0 cannot see rank 5's file 'custom.bin'" in str(err)


def test_lookups_wait_for_late_files_then_give_up(tmp_path: Path) -> None:
    (tmp_path / "a").write_text("x")
    assert _visible(tmp_path, {"a"}, wait_s=10.0) == ["a"]  # all there: no waiting
    assert _visible(tmp_path, {"a", "b"}, wait_s=0.05) == ["a"]
    assert missing(tmp_path, ["b", "a"], wait_s=0.05) == ["b"]
