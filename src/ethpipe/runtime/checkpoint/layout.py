"""Training checkpoints on disk: layout, manifest, atomic commit, discovery and validation.

A checkpoint directory holds one sub-directory per saved step::

    DIR/step-00000004/   .metadata, __<rank>_0.distcp (torch.distributed.checkpoint), ethpipe.json
    DIR/latest           "step-00000004" (convenience pointer for people and tools)
    DIR/.tmp-step-...    a save in progress, or the leftover of a killed one (removed by the next save)

A save is written under ``.tmp-step-N`` and becomes visible by one atomic rename after every
rank wrote its shards and rank 0 wrote the manifest (``ethpipe.json``: step, data cursor, the
plan and model spec that wrote it, crc32 and size of every file). So a ``step-N`` directory is
complete by construction, and the newest one is what ``--resume`` loads. Nothing here imports
the planner or needs a process group: the launcher validates a checkpoint before spawning.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ethpipe.atomic import fsync_path, write_text_atomic
from ethpipe.errors import UserError
from ethpipe.model_spec import ModelSpec
from ethpipe.runtime.model.decoder import Decoder, state_dict_shapes

FORMAT_VERSION = 1
MANIFEST = "ethpipe.json"
LATEST = "latest"
DCP_METADATA = ".metadata"
_STEP_RE = re.compile(r"^step-(\d{8,})$")
TMP_PREFIX = ".tmp-"
# Test-only hook: ranks raise after writing the shards of the save of this step, before the commit.
FAIL_SAVE_ENV = "ETHPIPE_TEST_FAIL_SAVE_AFTER_SHARDS"
_CRC_CHUNK_BYTES = 1 << 22


class InjectedSaveFailure(RuntimeError):
    """Raised by the test hook ``ETHPIPE_TEST_FAIL_SAVE_AFTER_SHARDS`` (a simulated crash mid-save)."""


@dataclass(frozen=True)
class DataCursor:
    """Where the global sample stream continues: sample ``next_sample`` of the (shuffled) order."""

    next_sample: int
    shuffle: bool
    seed: int
    num_samples: int  # samples in the data file (the shuffle permutation depends on it)


@dataclass(frozen=True)
class Manifest:
    step: int  # optimizer steps done = the next step to run
    cursor: DataCursor
    plan: dict[str, Any]  # the plan that wrote it (Plan.to_dict())
    model_spec: dict[str, Any]
    files: dict[str, tuple[int, int]]  # file name -> (size_bytes, crc32)
    saved_at: str = ""
    torch_version: str = ""
    format_version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1) + "\n"

    @staticmethod
    def from_json(text: str) -> Manifest:
        raw = json.loads(text)
        files = {k: (int(v[0]), int(v[1])) for k, v in raw["files"].items()}
        return Manifest(int(raw["step"]), DataCursor(**raw["cursor"]), raw["plan"], raw["model_spec"], files,
                        raw.get("saved_at", ""), raw.get("torch_version", ""), int(raw["format_version"]),
                        raw.get("extra", {}))


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def tmp_dir_name(step: int) -> str:
    return f"{TMP_PREFIX}{step_dir_name(step)}"


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """(step, directory) of every committed checkpoint under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for child in root.iterdir():
        match = _STEP_RE.match(child.name)
        if match and child.is_dir():
            out.append((int(match.group(1)), child))
    return sorted(out)


def resolve_checkpoint(path: str | Path) -> Path:
    """A step directory as given, or the newest committed checkpoint of a checkpoint root."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    if not path.is_dir():
        raise UserError(f"checkpoint directory '{path}' not found: give the --checkpoint-dir of a run")
    found = complete_checkpoints(path)
    if not found:
        partial = sorted(p.name for p in path.iterdir() if p.name.startswith(TMP_PREFIX))
        hint = f" (only the unfinished save '{partial[-1]}')" if partial else ""
        raise UserError(f"checkpoint directory '{path}' holds no complete checkpoint{hint}: "
                        "train without --resume to start one")
    return found[-1][1]


def read_manifest(step_dir: Path) -> Manifest:
    path = step_dir / MANIFEST
    if not path.is_file():
        raise UserError(f"checkpoint '{step_dir}' has no {MANIFEST}: it is incomplete; delete it to use an older one")
    try:
        manifest = Manifest.from_json(path.read_text())
    except (ValueError, KeyError, TypeError, IndexError) as err:
        raise UserError(f"checkpoint '{step_dir}' has a corrupt {MANIFEST} ({type(err).__name__}): "
                        "delete the directory to resume from an older checkpoint") from None
    if manifest.format_version != FORMAT_VERSION:
        raise UserError(f"checkpoint '{step_dir}' has format version {manifest.format_version}; this ethpipe "
                        f"reads version {FORMAT_VERSION}: use the ethpipe version that wrote it")
    return manifest


def check_files(step_dir: Path, manifest: Manifest, part: tuple[int, int] | None = None) -> Metadata:
    """Every file the manifest lists is there with its size; the DCP metadata reads and only names them.
    ``part`` (rank, world): a rank checks only its stride of the files, so the world stats each file once
    (O(1) per rank, not O(world)); the ranks settle their outcomes together (``start/preflight``)."""
    files = sorted(manifest.files.items())
    for name, (size_bytes, _crc) in (files if part is None else files[part[0]::part[1]]):
        path = step_dir / name
        if not path.is_file():
            raise UserError(f"checkpoint '{step_dir}' is missing file '{name}' (a lost shard): restore it, "
                            "or delete the directory to resume from an older checkpoint")
        if path.stat().st_size != size_bytes:
            raise UserError(f"checkpoint '{step_dir}' file '{name}' has {path.stat().st_size} bytes, not "
                            f"{size_bytes} (truncated or corrupt): restore it, or delete the directory")
    try:
        metadata = FileSystemReader(str(step_dir)).read_metadata()
    except Exception as err:  # noqa: BLE001 - any unreadable metadata is the same user error
        raise UserError(f"checkpoint '{step_dir}' file '{DCP_METADATA}' is corrupt ({type(err).__name__}): "
                        "restore it, or delete the directory to resume from an older checkpoint") from None
    for info in metadata.storage_data.values():
        if info.relative_path not in manifest.files:
            raise UserError(f"checkpoint '{step_dir}' refers to shard '{info.relative_path}' that its manifest "
                            "does not list: the directory mixes two saves; delete it")
    return metadata


def parameter_names(spec: ModelSpec) -> list[str]:
    """Names of the model's distinct parameters (a tied head is listed once, as the embedding)."""
    with torch.device("meta"):
        module = Decoder(spec, (0, spec.num_layers), True, True)
    return [name for name, _ in module.named_parameters()]


def optim_key(kind: str, name: str) -> str:
    """Global key of one AdamW state tensor, e.g. ``optim.exp_avg.layers.7.attn.wq.weight``."""
    return f"optim.{kind}.{name}"


def param_of_key(key: str) -> str:
    """The parameter a flat checkpoint key belongs to (the inverse of ``optim_key`` on its name part)."""
    return key.split(".", 2)[2] if key.startswith("optim.") else key


OPTIM_KINDS = ("step", "exp_avg", "exp_avg_sq")


def check_model(step_dir: Path, metadata: Metadata, spec: ModelSpec) -> None:
    """The checkpoint holds this model's every parameter (same shape) and its AdamW state."""
    have = metadata.state_dict_metadata
    for name, shape in state_dict_shapes(spec).items():
        entry = have.get(name)
        if not isinstance(entry, TensorStorageMetadata):
            raise UserError(f"checkpoint '{step_dir}' has no parameter '{name}': it is not a '{spec.name}' model; "
                            "resume with the model it was trained with, or use a fresh --checkpoint-dir")
        if tuple(entry.size) != shape:
            raise UserError(f"checkpoint '{step_dir}' has '{name}' of shape {list(entry.size)} but model "
                            f"'{spec.name}' needs {list(shape)}: it was saved from another model shape; resume "
                            "with the model it was trained with, or use a fresh --checkpoint-dir")
    for name in parameter_names(spec):
        for kind in OPTIM_KINDS:
            if optim_key(kind, name) not in have:
                raise UserError(f"checkpoint '{step_dir}' has no optimizer state '{optim_key(kind, name)}': "
                                "it was not written by `ethpipe train --checkpoint-dir`")


def crc32_file(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CRC_CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
    return crc


def corrupt_files(step_dir: Path, manifest: Manifest, names: list[str]) -> list[str]:
    """The given files whose crc32 differs from the manifest's (silent corruption: bit rot, bad copies)."""
    return [n for n in names if crc32_file(step_dir / n) != manifest.files[n][1]]


def corrupt_error(step_dir: Path, name: str) -> UserError:
    return UserError(f"checkpoint '{step_dir}' file '{name}' is corrupt (crc32 differs from its manifest): restore "
                      "it, or delete the directory to resume from an older checkpoint")


def _write_durable(path: Path, text: str) -> None:
    """Temp file + fsync + rename + directory fsync (a leftover of a kill is a ``.tmp-`` file, swept later)."""
    write_text_atomic(path, text, tmp_prefix=f"{TMP_PREFIX}{path.name}.")


def remove_partial(root: Path) -> None:
    """Delete leftovers of killed saves and prunes (``.tmp-*``); only ever called on rank 0."""
    for child in root.iterdir():
        if child.name.startswith(TMP_PREFIX):
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)


def commit(root: Path, tmp_dir: Path, manifest: Manifest, keep: int) -> Path:
    """Rank 0, after every rank wrote its shards: manifest, rename (the commit point), latest, prune."""
    _write_durable(tmp_dir / MANIFEST, manifest.to_json())
    final = root / step_dir_name(manifest.step)
    assert not final.exists(), f"{final} exists: a resumed run only saves steps after its checkpoint"
    os.replace(tmp_dir, final)
    fsync_path(root)
    _write_durable(root / LATEST, final.name + "\n")
    prune(root, keep)
    return final


def prune(root: Path, keep: int) -> None:
    """Keep the newest ``keep`` checkpoints; an old one is renamed away first, so it vanishes atomically."""
    for step, path in complete_checkpoints(root)[:-keep]:
        doomed = root / f"{TMP_PREFIX}deleting-{step_dir_name(step)}"
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def new_manifest(step: int, cursor: DataCursor, plan: dict[str, Any], spec: ModelSpec,
                 files: dict[str, tuple[int, int]], extra: dict[str, Any] | None = None) -> Manifest:
    """``extra``: run state beside weights and optimizer (the fp16 loss scaler)."""
    return Manifest(step, cursor, plan, spec.to_dict(), files, time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    torch.__version__, extra=dict(extra or {}))


def dir_size_bytes(step_dir: Path) -> int:
    return sum(p.stat().st_size for p in step_dir.iterdir() if p.is_file())


@dataclass(frozen=True)
class ResumePoint:
    """Where training starts: a fresh run (step 0, sample 0) or a validated checkpoint."""

    step: int = 0
    next_sample: int = 0
    step_dir: Path | None = None
    manifest: Manifest | None = None


def check_fresh_dir(root: str | Path) -> None:
    """Refuse to start from scratch over existing checkpoints (they would be overwritten)."""
    found = complete_checkpoints(root)
    if found:
        raise UserError(f"--checkpoint-dir '{root}' already holds checkpoints (newest: {found[-1][1].name}): "
                        "pass --resume to continue from it, or use another directory")


def find_resume(root: str | Path, spec: ModelSpec, seq_len: int, shuffle: bool, seed: int,
                num_samples: int, part: tuple[int, int] | None = None) -> ResumePoint:
    """The newest complete checkpoint under ``root``, checked against this run (before any process starts;
    ``part``: this rank's stride of the files, ``check_files``)."""
    step_dir = resolve_checkpoint(root)
    manifest = read_manifest(step_dir)
    metadata = check_files(step_dir, manifest, part)
    check_model(step_dir, metadata, spec)
    saved_seq = int(manifest.plan.get("seq_len", seq_len))
    if saved_seq != seq_len:
        raise UserError(f"checkpoint '{step_dir}' was trained with seq_len {saved_seq} but the plan has {seq_len}: "
                        "samples would mean other tokens; re-plan with the same seq_len")
    cur = manifest.cursor
    if cur.shuffle != shuffle or (shuffle and cur.seed != seed):
        given = f"--shuffle --seed {cur.seed}" if cur.shuffle else "no --shuffle"
        raise UserError(f"checkpoint '{step_dir}' was trained with {given}: pass the same to continue its sample "
                        "stream")
    if shuffle and cur.num_samples != num_samples:
        raise UserError(f"checkpoint '{step_dir}' shuffled {cur.num_samples} samples but the data file holds "
                        f"{num_samples}: resume with the same --data file")
    return ResumePoint(manifest.step, cur.next_sample, step_dir, manifest)
