"""Streaming `data prepare`: text / JSON lines / Parquet inputs, HF tokenizers with EOS, bounded memory."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import ethpipe.cli.commands  # noqa: F401  (registers the commands on the app)
from ethpipe.cli.app import app
from ethpipe.errors import UserError
from ethpipe.tokens import prepare
from ethpipe.runtime.data import open_tokens
from ethpipe.tokens.texts import prepare_tokens
from ethpipe.tokens.prepare import iter_docs, load_tokenizer, write_tokens

DOCS = ["The first document.\nIt has two lines.\n", "A second one, with ünïcode.", "Third: short."]


def _tokenizer_dir(tmp_path: Path) -> Path:
    """A small BPE tokenizer saved as a Hugging Face model directory (tokenizer.json + tokenizer_config.json)."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(DOCS * 20, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", unk_token="<unk>")
    fast.save_pretrained(tmp_path / "tok")
    return tmp_path / "tok"


def test_byte_level_stream_equals_the_in_memory_tokenizer_with_tiny_chunks(tmp_path, monkeypatch) -> None:
    big = "".join(f"line {i}: {'x' * (i % 37)}\n" for i in range(3000))
    (tmp_path / "a.txt").write_text(big)
    (tmp_path / "b.txt").write_text(DOCS[1])
    monkeypatch.setattr(prepare, "PIECE_CHARS", 100)
    monkeypatch.setattr(prepare, "BATCH_CHARS", 250)
    monkeypatch.setattr(prepare, "CHUNK_TOKENS", 64)
    pieces = list(iter_docs([tmp_path / "a.txt"]))
    assert len(pieces) > 100 and pieces[0].first and not any(p.first for p in pieces[1:])
    assert max(len(p.text) for p in pieces) < 100 + 60  # a piece ends at the first line end past PIECE_CHARS
    count = write_tokens(iter_docs([tmp_path / "a.txt", tmp_path / "b.txt"]), tmp_path / "s.bin")
    prepare_tokens([big, DOCS[1]], tmp_path / "m.bin")
    assert (tmp_path / "s.bin").read_bytes() == (tmp_path / "m.bin").read_bytes()
    assert count == len((big + "\n\n" + DOCS[1]).encode())


def test_jsonl_and_parquet_with_a_hf_tokenizer_directory(tmp_path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    tok_dir = _tokenizer_dir(tmp_path)
    tok, eos = load_tokenizer(tok_dir)
    assert tok.id_to_token(eos) == "<|endoftext|>"
    assert load_tokenizer(tok_dir / "tokenizer.json")[1] == eos  # the bare file finds the well-known EOS too
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(DOCS[:2])))
    pq.write_table(pa.table({"body": [DOCS[2]], "n": [1]}), tmp_path / "d.parquet")
    count = write_tokens(iter_docs([tmp_path / "d.jsonl", tmp_path / "d.parquet"], field="body"),
                         tmp_path / "t.bin", tokenizer=tok_dir)
    want: list[int] = []
    for i, doc in enumerate(DOCS):
        want += ([eos] if i else []) + tok.encode(doc, add_special_tokens=False).ids
    got = open_tokens(tmp_path / "t.bin", tok.get_vocab_size()).tokens
    assert got.dtype == np.uint16 and got.tolist() == want and count == len(want)
    assert json.loads((tmp_path / "t.bin.json").read_text())["eos_id"] == eos


def test_large_vocabulary_gets_uint32(tmp_path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(70_000)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("w69999 w3 w70000")
    write_tokens(iter_docs([tmp_path / "a.txt"]), tmp_path / "t.bin", tokenizer=tmp_path / "tokenizer.json")
    got = open_tokens(tmp_path / "t.bin", 70_002).tokens
    assert got.dtype == np.uint32 and got.tolist() == [70_001, 5, 0]


def test_bad_inputs(tmp_path) -> None:
    (tmp_path / "d.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(UserError, match="line 1 has no string field 'text'"):
        write_tokens(iter_docs([tmp_path / "d.jsonl"]), tmp_path / "t.bin")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(UserError, match="line 1 is not JSON"):
        write_tokens(iter_docs([tmp_path / "bad.jsonl"]), tmp_path / "t.bin")
    assert not (tmp_path / "t.bin").exists() and not list(tmp_path.glob(".t.bin*"))  # nothing half-written
    with pytest.raises(UserError, match="has no tokenizer.json"):
        load_tokenizer(tmp_path)
    result = CliRunner().invoke(app, ["data", "prepare", "--input", str(tmp_path / "d.jsonl"), "--field", "nope",
                                      "--out", str(tmp_path / "t.bin"), "--no-progress"])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output


def test_cli_prepares_with_a_model_directory_tokenizer(tmp_path) -> None:
    tok_dir = _tokenizer_dir(tmp_path)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    result = CliRunner().invoke(app, ["data", "prepare", "--input", str(tmp_path / "d.jsonl"), "--tokenizer",
                                      str(tok_dir), "--out", str(tmp_path / "t.bin")])
    assert result.exit_code == 0, result.output
    tok, eos = load_tokenizer(tok_dir)
    assert open_tokens(tmp_path / "t.bin", tok.get_vocab_size()).tokens.tolist().count(eos) == len(DOCS) - 1


_RSS_SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from ethpipe.tokens.prepare import iter_docs, write_tokens

    def peak_kib():  # VmHWM: this process's own peak (ru_maxrss would keep the forking pytest's across exec)
        line = next(x for x in open("/proc/self/status") if x.startswith("VmHWM:"))
        return int(line.split()[1])

    path = Path(sys.argv[1])
    with open(path, "w") as f:
        line = json.dumps({"text": "streaming keeps memory flat " * 40}) + "\\n"
        for _ in range(int(sys.argv[2]) // len(line)):
            f.write(line)
    count = write_tokens(iter_docs([path]), path.with_suffix(".bin"))
    print(json.dumps({"count": count, "peak_kib": peak_kib()}))
""")


def test_peak_memory_stays_flat_as_the_input_grows(tmp_path) -> None:
    """8 MB and 48 MB of JSON lines. Holding the documents and their tokens in memory (the old
    prepare_tokens) peaks 267 MiB higher on the bigger one (measured: 80 vs 347 MiB); streaming
    holds one batch and one chunk, whatever the input size."""
    if not Path("/proc/self/status").is_file():
        pytest.skip("peak RSS is read from /proc/self/status (Linux)")
    runs = {}
    for size in (8_000_000, 48_000_000):
        proc = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(tmp_path / f"in{size}.jsonl"), str(size)],
                              capture_output=True, text=True, timeout=240, check=True)
        runs[size] = json.loads(proc.stdout)
    small, big = runs[8_000_000], runs[48_000_000]
    assert big["count"] > 5 * small["count"]
    growth_mib = (big["peak_kib"] - small["peak_kib"]) / 1024
    print(f"peak RSS {small['peak_kib'] / 1024:.1f} MiB (8 MB input) vs {big['peak_kib'] / 1024:.1f} MiB "
          f"(48 MB input): +{growth_mib:.1f} MiB")
    assert growth_mib < 10
