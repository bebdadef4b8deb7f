"""Token files and the global data order (docs/design.md §3)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ethpipe.runtime.data import gather_samples, open_tokens, step_sample_ids, validate_data
from ethpipe.tokens.format import token_dtype
from ethpipe.tokens.texts import builtin_text, prepare_tokens


def _write(path: Path, tokens: np.ndarray) -> Path:
    tokens.tofile(path)
    return path


def test_sample_formula(tmp_path: Path) -> None:
    data = open_tokens(_write(tmp_path / "t.bin", np.arange(100, dtype=np.uint16)), vocab_size=256)
    assert data.num_samples(8) == 12  # (100 - 1) // 8
    rows = gather_samples(data, np.array([0, 3]), 8)
    assert rows.tolist() == [list(range(0, 9)), list(range(24, 33))]


def test_step_order_and_shuffle() -> None:
    assert step_sample_ids(2, 4, 100, False, 0).tolist() == [8, 9, 10, 11]
    a = np.concatenate([step_sample_ids(k, 5, 20, True, 3) for k in range(4)])
    assert sorted(a.tolist()) == list(range(20))  # a permutation: no sample twice
    assert a.tolist() == np.concatenate([step_sample_ids(k, 5, 20, True, 3) for k in range(4)]).tolist()
    assert a.tolist() != np.concatenate([step_sample_ids(k, 5, 20, True, 4) for k in range(4)]).tolist()


def test_validation_errors(tmp_path: Path) -> None:
    data = open_tokens(_write(tmp_path / "t.bin", np.arange(100, dtype=np.uint16)), vocab_size=256)
    validate_data(data, 8, 4, 3, False, 256)
    with pytest.raises(ValueError, match="needs 16"):
        validate_data(data, 8, 4, 4, False, 256)
    with pytest.raises(ValueError, match="token id 32 but the model's vocab_size is 32"):
        validate_data(data, 8, 4, 1, False, 32)
    validate_data(data, 8, 2, 1, False, 32)  # only the tokens a run will read are checked (no shuffle)
    with pytest.raises(ValueError, match="not found"):
        open_tokens(tmp_path / "missing.bin", 256)


def test_dtype_from_vocab_or_sidecar(tmp_path: Path) -> None:
    assert token_dtype(50257) == np.uint16 and token_dtype(128256) == np.uint32
    path = _write(tmp_path / "big.bin", np.array([70000, 1, 2], dtype=np.uint32))
    assert open_tokens(path, 128256).tokens.tolist() == [70000, 1, 2]
    (tmp_path / "big.bin.json").write_text(json.dumps({"dtype": "uint32", "vocab_size": 128256}))
    assert open_tokens(path, 256).tokens.dtype == np.uint32


def test_prepare_bytes_roundtrip(tmp_path: Path) -> None:
    count = prepare_tokens(["héllo", "world"], tmp_path / "o.bin")
    data = open_tokens(tmp_path / "o.bin", 256)
    assert count == data.num_tokens
    assert bytes(data.tokens.astype(np.uint8)).decode() == "héllo\n\nworld"
    assert json.loads((tmp_path / "o.bin.json").read_text()) == {"dtype": "uint16", "vocab_size": 256,
                                                                 "num_tokens": count, "max_token_id": 195,  # 'é'
                                                                 "num_documents": 2}


def test_tokenizer_needs_package_or_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokeniz"):
        prepare_tokens(["text"], tmp_path / "o.bin", tokenizer=tmp_path / "missing.json")
    assert not (tmp_path / "o.bin").exists()


def test_builtin_text_is_real_english() -> None:
    docs = builtin_text(max_bytes=50_000)
    text = " ".join(docs)
    assert len(text) >= 50_000 and text.count(" the ") > 100
    assert docs == builtin_text(max_bytes=50_000)  # deterministic


def test_the_sidecar_records_the_largest_id_and_validation_trusts_it(tmp_path: Path) -> None:
    prepare_tokens(["héllo", "world"], tmp_path / "o.bin")
    meta = json.loads((tmp_path / "o.bin.json").read_text())
    assert meta["max_token_id"] == max("héllo\n\nworld".encode())
    validate_data(open_tokens(tmp_path / "o.bin", 256), 4, 1, 1, False, 256)
    meta["max_token_id"] = 300  # no scan: a run reads the sidecar's maximum (the file's ids are all < 256)
    (tmp_path / "o.bin.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="token id 300 but the model's vocab_size is 256"):
        validate_data(open_tokens(tmp_path / "o.bin", 256), 4, 1, 1, False, 256)
    meta["num_tokens"] += 1  # the sidecar of another file: its maximum is not trusted, the file is scanned
    (tmp_path / "o.bin.json").write_text(json.dumps(meta))
    assert open_tokens(tmp_path / "o.bin", 256).max_token_id is None
    validate_data(open_tokens(tmp_path / "o.bin", 256), 4, 1, 1, False, 256)


def test_the_shuffled_order_is_numpys_seeded_permutation_made_once() -> None:
    want = np.random.default_rng(7).permutation(50)
    got = np.concatenate([step_sample_ids(k, 10, 50, True, 7) for k in range(5)])
    assert got.tolist() == want.tolist() and got.dtype == np.int64
    from ethpipe.runtime.data import _permutation

    assert _permutation(50, 7) is _permutation(50, 7)  # computed once, not every step


def test_raw_text_passed_as_tokens_is_refused_with_the_command_that_tokenizes_it(tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("The quick brown fox jumps over the lazy dog.\nNaïve café, déjà vu.\n" * 50)  # odd length too
    with pytest.raises(ValueError, match=r"is text, not tokens: .*ethpipe data prepare --text .*corpus.txt") as err:
        open_tokens(text, 50257)
    assert "\n" not in str(err.value)
    gpt2_like = _write(tmp_path / "ids.bin", np.random.default_rng(0).integers(0, 50257, 4096, dtype=np.uint16))
    assert open_tokens(gpt2_like, 50257).num_tokens == 4096  # real token ids are not text
    printable = _write(tmp_path / "bytes.bin", np.frombuffer(b"ab" * 64, dtype=np.uint16).copy())
    (tmp_path / "bytes.bin.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 50257}))
    assert open_tokens(printable, 50257).num_tokens == 64  # a sidecar says it is tokens: trusted
