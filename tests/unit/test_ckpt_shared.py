"""The shared-filesystem check of checkpoints, without a process group (the collective: tests/dist)."""

from pathlib import Path

from ethpipe.errors import UserError
from ethpipe.runtime.checkpoint.shared_fs import _visible, visibility_error

HINT = "use a shared filesystem (NFS, Lustre, ...) for --checkpoint-dir"


def test_every_rank_seeing_everything_passes() -> None:
    names = {".metadata", "__0_0.distcp", "__1_0.distcp"}
    assert visibility_error("/ckpt", [names, set(names), set(names)]) is None


def test_node_local_disks_name_the_blind_rank_and_the_writer() -> None:
    # Ranks 0-1 on node A (rank 0 also wrote .metadata), ranks 2-3 on node B.
    node_a = {".metadata", "__0_0.distcp", "__1_0.distcp"}
    node_b = {"__2_0.distcp", "__3_0.distcp"}
    err = visibility_error("/local/ckpt", [node_a, node_a, node_b, node_b])
    assert str(err) == ("checkpoint dir '/local/ckpt' is not on a filesystem shared by all ranks: rank 0 cannot see "
                        f"rank 2's file '__2_0.distcp' and 1 more; {HINT}")
    assert isinstance(err, UserError)
    err = visibility_error("/ckpt", [node_a | node_b] * 3 + [(node_a | node_b) - {".metadata"}])
    assert "rank 3 cannot see rank 0's file '.metadata';" in str(err)


def test_a_file_only_other_ranks_see_is_attributed_to_the_lowest() -> None:
    err = visibility_error("/ckpt", [set(), {"ethpipe.json"}, {"ethpipe.json"}])
    assert "rank 0 cannot see rank 1's file 'ethpipe.json'" in str(err)


def test_lookups_wait_for_late_files_then_give_up(tmp_path: Path) -> None:
    (tmp_path / "a").write_text("x")
    assert _visible(tmp_path, {"a"}, wait_s=10.0) == ["a"]  # all there: no waiting
    assert _visible(tmp_path, {"a", "b"}, wait_s=0.05) == ["a"]
