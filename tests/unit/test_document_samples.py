"""`--samples documents` (runtime/data.DocumentSamples): the document index `data prepare` writes, samples that
never cross a document, every target counted exactly once, padding ignored."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ethpipe.errors import UserError
from ethpipe.runtime.data import IGNORE_TARGET, DocumentSamples, gather_samples, open_tokens, with_documents
from ethpipe.tokens.format import documents_path
from ethpipe.tokens.split import split_validation, val_path
from ethpipe.tokens.texts import prepare_tokens


def test_samples_cover_every_target_once_and_never_cross_a_document() -> None:
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 60, size=200)
    doc_starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    total = int(sizes.sum())
    for seq_len in (1, 4, 16, 64):
        s = DocumentSamples.build(doc_starts, total, seq_len)
        assert s.lengths.min() >= 2 and s.lengths.max() <= seq_len + 1
        doc_of = np.searchsorted(doc_starts, s.starts, side="right") - 1
        assert np.all(s.starts + s.lengths <= np.append(doc_starts[1:], total)[doc_of])  # inside its document
        targets = np.concatenate([np.arange(a + 1, a + n) for a, n in zip(s.starts, s.lengths)])
        want = np.concatenate([np.arange(a + 1, a + n) for a, n in zip(doc_starts, sizes) if n >= 2])
        assert np.array_equal(np.sort(targets), want)  # each document's targets, each once


def test_prepare_writes_the_index_and_the_split_keeps_it(tmp_path: Path) -> None:
    docs = [f"d{k} " + "w" * k for k in range(1, 41)]
    out = tmp_path / "t.bin"
    prepare_tokens(docs, out)
    starts = np.fromfile(documents_path(out), dtype=np.int64)
    tokens = np.fromfile(out, dtype=np.uint16)
    assert len(starts) == 40 and np.all(tokens[starts] == ord("d")) and starts[0] == 0
    split_validation(out, 0.3)
    for path in (out, val_path(out)):
        index = np.fromfile(documents_path(path), dtype=np.int64)
        data = np.fromfile(path, dtype=np.uint16)
        assert index[0] == 0 and np.all(data[index] == ord("d"))  # every index entry is a document's first token


def test_padding_is_ignored_and_inputs_are_tokens(tmp_path: Path) -> None:
    out = tmp_path / "t.bin"
    prepare_tokens(["ab", "c" * 40], out)
    data = with_documents(open_tokens(out, 256), 16)
    rows = gather_samples(data, np.arange(data.num_samples(16)), 16)
    assert rows[0, 4] == IGNORE_TARGET and data.counted_tokens(np.array([0]), 16) == 3  # "ab\n\n": 4 tokens, 3 targets
    assert data.counted_tokens(np.arange(data.num_samples(16)), 16) == 3 + 39


def test_a_file_without_an_index_is_one_line(tmp_path: Path) -> None:
    out = tmp_path / "t.bin"
    prepare_tokens(["abc"], out)
    documents_path(out).unlink()
    with pytest.raises(UserError, match="has no document index .* re-make it with `ethpipe data prepare`"):
        with_documents(open_tokens(out, 256), 8)
