"""Streaming tokenization for ``ethpipe data prepare``: text, JSON lines and Parquet, of any size.

Documents are read one at a time (a plain text file in pieces cut at line ends), tokenized in
batches of about ``BATCH_CHARS`` characters and appended to the output in chunks, so memory stays
bounded by the batch and chunk sizes, not the input (tests/unit/test_prepare.py measures peak RSS
at two input sizes). Byte-level tokens (vocab 256) separate documents by a blank line, as before;
a Hugging Face tokenizer separates them by its EOS token. The file appears atomically at the end.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ethpipe.atomic import atomic_path, write_bytes_atomic
from ethpipe.errors import UserError
from ethpipe.tokens.format import documents_path, sidecar_path, token_dtype

BATCH_CHARS = 1 << 20  # text handed to the tokenizer at once
PIECE_CHARS = 1 << 20  # a plain text file is read in pieces of about this size, cut at line ends
CHUNK_TOKENS = 1 << 20  # tokens buffered before they are written
PARQUET_ROWS = 256
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>", "<|eot_id|>")

Progress = Callable[[int], None]  # called with bytes of input consumed


@dataclass(frozen=True)
class Doc:
    """A piece of text; ``first`` marks the start of a document (a separator goes before it)."""

    text: str
    first: bool
    nbytes: int  # input bytes it stands for (progress)


def input_kind(path: Path) -> str:
    suffix = path.suffix.lower()
    return "jsonl" if suffix in (".jsonl", ".ndjson") else "parquet" if suffix == ".parquet" else "text"


def _text_docs(path: Path) -> Iterator[Doc]:
    with open(path, encoding="utf-8", errors="replace") as f:
        first, piece, size = True, [], 0
        for line in f:
            piece.append(line)
            size += len(line)
            if size >= PIECE_CHARS:
                text = "".join(piece)
                yield Doc(text, first, len(text.encode("utf-8", errors="replace")))
                first, piece, size = False, [], 0
        if piece or first:
            text = "".join(piece)
            yield Doc(text, first, len(text.encode("utf-8", errors="replace")))


def _jsonl_docs(path: Path, field: str) -> Iterator[Doc]:
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise UserError(f"'{path}' line {number} is not JSON ({str(err).splitlines()[0]})") from None
            if not isinstance(record, dict) or not isinstance(record.get(field), str):
                raise UserError(f"'{path}' line {number} has no string field '{field}': pass --field NAME")
            yield Doc(record[field], True, len(raw))


def _parquet_docs(path: Path, field: str) -> Iterator[Doc]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError("Parquet input needs the optional 'pyarrow' package: pip install 'ethpipe[hf]'") from None
    try:
        file = pq.ParquetFile(path)
    except Exception as err:  # noqa: BLE001 - any unreadable file is the same user error
        raise UserError(f"'{path}' is not a readable Parquet file: {str(err).splitlines()[0]}") from None
    if field not in file.schema_arrow.names:
        raise UserError(f"'{path}' has no column '{field}' (columns: {', '.join(file.schema_arrow.names)}): "
                        "pass --field NAME")
    rows = max(1, file.metadata.num_rows)
    per_row = path.stat().st_size / rows
    for batch in file.iter_batches(batch_size=PARQUET_ROWS, columns=[field]):
        for value in batch.column(0).to_pylist():
            if value is not None:
                yield Doc(str(value), True, int(per_row))


def iter_docs(paths: Iterable[Path], field: str = "text") -> Iterator[Doc]:
    """Every document of every input, streamed; the kind of each file comes from its suffix."""
    for path in paths:
        if not path.is_file():
            raise UserError(f"input file '{path}' not found")
        kind = input_kind(path)
        if kind == "jsonl":
            yield from _jsonl_docs(path, field)
        elif kind == "parquet":
            yield from _parquet_docs(path, field)
        else:
            yield from _text_docs(path)


def load_tokenizer(path: str | Path) -> tuple[Any, int]:
    """A HF tokenizer (a tokenizer.json, or a model directory holding one) and its EOS id."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UserError("--tokenizer needs the optional 'tokenizers' package: pip install 'ethpipe[hf]', or omit "
                        "--tokenizer for byte-level tokens") from None
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise UserError(f"--tokenizer '{path}' has no tokenizer.json: give a Hugging Face tokenizer.json or a model "
                        "directory that holds one")
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as err:  # noqa: BLE001 - any unreadable file is the same user error
        raise UserError(f"--tokenizer '{file}' is not a readable tokenizer.json: {str(err).splitlines()[0]}") from None
    eos = _eos_id(tok, file.parent)
    if eos is None:
        raise UserError(f"--tokenizer '{path}' names no EOS token (tokenizer_config.json eos_token, config.json "
                        f"eos_token_id, or one of {', '.join(EOS_CANDIDATES)})")
    return tok, eos


def _eos_id(tok: Any, folder: Path) -> int | None:
    """EOS from tokenizer_config.json, else config.json / generation_config.json, else a well-known token."""
    side = folder / "tokenizer_config.json"
    if side.is_file():
        eos = json.loads(side.read_text()).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str) and tok.token_to_id(eos) is not None:
            return int(tok.token_to_id(eos))
    for name in ("generation_config.json", "config.json"):
        if (folder / name).is_file():
            eos_id = json.loads((folder / name).read_text()).get("eos_token_id")
            eos_id = eos_id[0] if isinstance(eos_id, list) and eos_id else eos_id
            if isinstance(eos_id, int):
                return eos_id
    for token in EOS_CANDIDATES:
        if tok.token_to_id(token) is not None:
            return int(tok.token_to_id(token))
    return None


class _ChunkWriter:
    """Appends token arrays to an open file, buffering at most ``CHUNK_TOKENS`` of them."""

    def __init__(self, f: Any, dtype: np.dtype) -> None:
        self.f, self.dtype, self.parts, self.buffered, self.count = f, dtype, [], 0, 0
        self.max_id = -1  # recorded in the sidecar, so a run checks ids against its vocab without a scan

    def add(self, ids: np.ndarray) -> None:
        self.parts.append(ids.astype(self.dtype, copy=False))
        self.buffered += ids.size
        if ids.size:
            self.max_id = max(self.max_id, int(ids.max()))
        if self.buffered >= CHUNK_TOKENS:
            self.flush()

    def flush(self) -> None:
        if self.parts:
            self.f.write(np.concatenate(self.parts).tobytes())
            self.count += self.buffered
        self.parts, self.buffered = [], 0


def _batches(docs: Iterable[Doc]) -> Iterator[list[Doc]]:
    batch: list[Doc] = []
    size = 0
    for doc in docs:
        batch.append(doc)
        size += len(doc.text)
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def write_tokens(docs: Iterable[Doc], out: str | Path, tokenizer: str | Path | None = None,
                 progress: Progress | None = None) -> int:
    """Tokenize ``docs`` into ``out`` (+ ``.json`` sidecar: dtype, vocab, eos); returns the token count."""
    tok, eos = load_tokenizer(tokenizer) if tokenizer is not None else (None, None)
    vocab_size = 256 if tok is None else int(tok.get_vocab_size(with_added_tokens=True))
    dtype = token_dtype(vocab_size)
    separator = np.frombuffer(b"\n\n", dtype=np.uint8) if tok is None else np.asarray([eos])
    out = Path(out)
    started = False
    starts = array("q")  # each document's first token offset
    with atomic_path(out) as tmp, open(tmp, "wb") as f:
        writer = _ChunkWriter(f, dtype)
        for batch in _batches(docs):
            if tok is None:
                encoded = [np.frombuffer(d.text.encode("utf-8"), dtype=np.uint8) for d in batch]
            else:
                encoded = [np.asarray(e.ids, dtype=np.int64)
                           for e in tok.encode_batch([d.text for d in batch], add_special_tokens=False)]
            for doc, ids in zip(batch, encoded):
                if doc.first and started:
                    writer.add(separator)
                if doc.first:
                    starts.append(writer.count + writer.buffered)
                started = True
                writer.add(ids)
            if progress is not None:
                progress(sum(d.nbytes for d in batch))
        writer.flush()
        if writer.count < 2:
            raise UserError("the given text is empty: nothing to tokenize")
        f.flush()
    meta = {"dtype": str(dtype), "vocab_size": vocab_size, "num_tokens": writer.count, "max_token_id": writer.max_id,
            "num_documents": len(starts), **({"eos_id": eos} if eos is not None else {})}
    write_bytes_atomic(documents_path(out), np.asarray(starts, dtype=np.int64).tobytes())
    write_bytes_atomic(sidecar_path(out), json.dumps(meta).encode())
    return writer.count
