"""Token files (nanoGPT ``.bin``: a flat uint16/uint32 array) and the global data order.

docs/design.md §3: sample i is ``tokens[i*s : i*s + s + 1]`` (inputs and shifted targets); step k takes
samples ``[k*B, (k+1)*B)`` (through a seeded permutation with ``shuffle``), split across
pipelines and micro-batches in plan order. Every rank derives its own slice from the same
formula, so no data is ever sent between ranks and a re-planned run continues in order.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from ethpipe.errors import UserError
from ethpipe.plan import Plan
from ethpipe.tokens.format import documents_path, sidecar_path, token_dtype

_CHECK_CHUNK = 1 << 24


@dataclass(frozen=True)
class TokenFile:
    path: Path
    tokens: np.ndarray  # read-only memmap
    max_token_id: int | None = None  # from the sidecar (``data prepare`` records it); None: scan to check
    documents: DocumentSamples | None = None  # ``--samples documents``: samples within one document each

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    def num_samples(self, seq_len: int) -> int:
        if self.documents is not None:
            return len(self.documents.starts)
        return max(0, (self.num_tokens - 1) // seq_len)

    def counted_tokens(self, ids: np.ndarray, seq_len: int) -> int:
        """How many targets of these samples count in the loss: all of them, or (documents) the unpadded ones."""
        if self.documents is None:
            return len(ids) * seq_len
        return int((self.documents.lengths[ids] - 1).sum())


IGNORE_TARGET = -100  # a padded position: its target is not counted (cross-entropy's ignore_index)


@dataclass(frozen=True)
class DocumentSamples:
    """``--samples documents``: every sample lies inside one document and starts at its beginning or at a multiple
    of ``seq_len`` into it (a long document is several samples), so no sample attends across a document boundary
    or predicts the next document's first token. A short sample is padded; its padded targets are
    ``IGNORE_TARGET`` and the step's loss is the mean over the counted targets of the whole global batch
    (``TokenFile.counted_tokens``), so uneven data per pipeline never reweights the loss."""

    starts: np.ndarray  # int64 token offset of each sample
    lengths: np.ndarray  # int64 tokens of each sample (2 .. seq_len + 1)

    @classmethod
    def build(cls, doc_starts: np.ndarray, num_tokens: int, seq_len: int) -> DocumentSamples:
        ends = np.append(doc_starts[1:], num_tokens)  # a document ends with its separator (EOS): predicting it is
        sizes = ends - doc_starts  # learning where documents end, as GPT-style training does
        keep = sizes >= 2  # a sample needs an input and a target
        doc_starts, sizes = doc_starts[keep], sizes[keep]
        per_doc = (sizes - 2) // seq_len + 1  # samples of a document: one per seq_len tokens of targets
        first = np.repeat(doc_starts, per_doc)
        k = np.arange(per_doc.sum()) - np.repeat(np.cumsum(per_doc) - per_doc, per_doc)
        starts = first + k * seq_len
        remaining = np.repeat(doc_starts + sizes, per_doc) - starts
        return cls(starts.astype(np.int64), np.minimum(remaining, seq_len + 1).astype(np.int64))


def with_documents(data: TokenFile, seq_len: int) -> TokenFile:
    """``data`` sampled by document (its ``.bin.docs`` index, written by ``data prepare``)."""
    path = documents_path(data.path)
    if not path.is_file():
        raise UserError(f"data file '{data.path}' has no document index ({path.name}): re-make it with "
                        "`ethpipe data prepare`, or train with --samples packed")
    starts = np.fromfile(path, dtype=np.int64)
    return dataclasses.replace(data, documents=DocumentSamples.build(starts, data.num_tokens, seq_len))


def open_tokens(path: str | Path, vocab_size: int) -> TokenFile:
    """Memory-map a token file; the dtype comes from its ``.json`` sidecar if present, else from the vocab."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"data file '{path}' not found: make one with `ethpipe data prepare --out {path}`")
    dtype = token_dtype(vocab_size)
    side = sidecar_path(path)
    meta = json.loads(side.read_text()) if side.is_file() else {}
    if not meta and _looks_like_text(path):
        raise UserError(f"data file '{path}' is text, not tokens: tokenize it first with "
                        f"`ethpipe data prepare --text {path} --out {path.with_suffix('.bin')}` and pass that file")
    if meta:
        dtype = np.dtype(meta["dtype"])
    if path.stat().st_size % dtype.itemsize:
        raise UserError(f"data file '{path}' has {path.stat().st_size} bytes, not a whole number of {dtype} tokens")
    if path.stat().st_size == 0:
        raise UserError(f"data file '{path}' is empty")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    max_id = meta.get("max_token_id")
    if meta.get("num_tokens") != tokens.shape[0]:  # a sidecar of another (or a rewritten) file: scan instead
        max_id = None
    return TokenFile(path, tokens, int(max_id) if max_id is not None else None)


def _looks_like_text(path: Path, probe_bytes: int = 4096) -> bool:
    """A file without a sidecar whose first bytes are UTF-8 text of printable characters and whitespace (token
    ids as uint16/uint32 have NUL and control bytes within the first few tokens of any real corpus)."""
    with open(path, "rb") as f:
        head = f.read(probe_bytes)
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:  # a multi-byte character cut at the probe's end is still text
        try:
            text = head[:-3].decode("utf-8")
        except UnicodeDecodeError:
            return False
    return bool(text) and all(c.isprintable() or c in "\n\r\t" for c in text)


@lru_cache(maxsize=2)
def _permutation(num_samples: int, seed: int) -> np.ndarray:
    """The seeded order of a run's samples, made once per process (a pure function, memoised: recomputing
    it every step took 1.6 s at 10M samples), in the smallest integer type that holds the indices."""
    order = np.random.default_rng(seed).permutation(num_samples)
    order = order.astype(np.uint32 if num_samples <= np.iinfo(np.uint32).max else np.int64)
    order.flags.writeable = False
    return order


def sample_ids(first_sample: int, count: int, num_samples: int, shuffle: bool, seed: int) -> np.ndarray:
    """Global sample indices ``[first, first + count)`` of the (seeded, shuffled) order: the data cursor
    counts samples, not steps, so a run resumed under a plan with another batch size continues exactly."""
    ids = np.arange(first_sample, first_sample + count)
    if shuffle:
        ids = _permutation(num_samples, seed)[ids].astype(np.int64)
    return ids


def step_sample_ids(step: int, global_batch_size: int, num_samples: int, shuffle: bool, seed: int) -> np.ndarray:
    """Global sample indices of step ``step`` of a run that started at sample 0 (plan order)."""
    return sample_ids(step * global_batch_size, global_batch_size, num_samples, shuffle, seed)


def gather_samples(data: TokenFile, sample_ids: np.ndarray, seq_len: int) -> np.ndarray:
    """(n, seq_len + 1) int64 array of the given samples (documents: padded with ``IGNORE_TARGET``; the model's
    inputs take padding as token 0, ``model_inputs``)."""
    if data.documents is not None:
        out = np.full((len(sample_ids), seq_len + 1), IGNORE_TARGET, dtype=np.int64)
        for row, i in enumerate(sample_ids):
            start, length = int(data.documents.starts[i]), int(data.documents.lengths[i])
            out[row, :length] = data.tokens[start:start + length]
        return out
    rows = [np.asarray(data.tokens[i * seq_len: i * seq_len + seq_len + 1], dtype=np.int64) for i in sample_ids]
    return np.stack(rows) if rows else np.zeros((0, seq_len + 1), dtype=np.int64)


def model_inputs(rows: torch.Tensor) -> torch.Tensor:
    """A micro-batch's input tokens (its rows but the last token; padding as token 0, whose targets do not count)."""
    return rows[:, :-1].clamp_min(0).contiguous()


def validate_data(data: TokenFile, seq_len: int, global_batch_size: int, num_steps: int, shuffle: bool,
                  vocab_size: int) -> None:
    """Fail before training if the file is too short or holds ids the model cannot embed."""
    available = data.num_samples(seq_len)
    needed = num_steps * global_batch_size
    if needed > available:
        raise UserError(
            f"data file '{data.path}' holds {available} samples of {seq_len}+1 tokens but --steps {num_steps} x "
            f"global_batch_size {global_batch_size} needs {needed}: use fewer --steps or more data"
        )
    end = data.num_tokens if shuffle or data.documents is not None else needed * seq_len + 1
    # The sidecar's maximum covers the whole file: no scan on any rank (a scan of a 100 GB file took minutes).
    maxima = [data.max_token_id] if data.max_token_id is not None else (
        int(data.tokens[lo:min(end, lo + _CHECK_CHUNK)].max()) for lo in range(0, end, _CHECK_CHUNK))
    for top in maxima:
        if top >= vocab_size:
            raise UserError(
                f"data file '{data.path}' holds token id {top} but the model's vocab_size is {vocab_size}: "
                "tokenize with the model's tokenizer"
            )


def micro_batches(plan: Plan, data: TokenFile, ids: np.ndarray, pipeline: int,
                   device: torch.device) -> list[torch.Tensor]:
    """This pipeline's micro-batches (tokens and the next token, on ``device``) of a step's global sample ids,
    under ``plan``'s split."""
    out = []
    for lo, hi in plan.microbatch_slices(pipeline):
        rows = torch.from_numpy(gather_samples(data, ids[lo:hi], plan.seq_len))
        if device.type == "cuda":  # pinned: the copy runs on the stream without holding the host
            rows = rows.pin_memory().to(device, non_blocking=True)
        out.append(rows.to(device))
    return out
