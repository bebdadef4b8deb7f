"""One rank's share of a training checkpoint, saved and loaded with torch.distributed.checkpoint.

Every key is global, so a checkpoint does not depend on the plan that wrote it: model keys as
in ``build_full_model(spec).state_dict()`` (``layers.7.attn.wq.weight``), AdamW state as
``optim.<step|exp_avg|exp_avg_sq>.<parameter>``, RNG states as ``rng.<device>.rank<r>``. Each rank
hands DCP only what its stage holds; replicas in other pipelines present the same keys with
identical values and DCP's save planner writes each key once (deduplicated, load-balanced over
the holders). Loading asks for exactly the keys of the rank's stage under the *new* plan, so a
checkpoint loads under any plan: other pipelines, depths and layer splits. A tied model's
last-stage copy of the embedding is ``tok_emb.weight`` too (runtime/model/decoder.py): one more replica
of that key (and of its AdamW state), so tied checkpoints reshard like any other.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.futures import Future

from ethpipe.errors import UserError
from ethpipe.model_spec import ModelSpec, spec_from_dict
from ethpipe.plan import Plan
from ethpipe.runtime.checkpoint.shared_fs import SharedFilesystemError, blind_error, missing, settle_on_rank0
from ethpipe.runtime.adapt.fault_hooks import KillSpec, kill_spec, maybe_enospc, maybe_kill
from ethpipe.runtime.checkpoint.layout import (
    DCP_METADATA, FAIL_SAVE_ENV, MANIFEST, OPTIM_KINDS, DataCursor, InjectedSaveFailure, ResumePoint,
    check_files, commit, complete_checkpoints, corrupt_error, corrupt_files, crc32_file, dir_size_bytes,
    new_manifest, optim_key, param_of_key, read_manifest, remove_partial, resolve_checkpoint, tmp_dir_name,
)
from ethpipe.runtime.checkpoint.tp_shards import KeyWriters, ShardViews
from ethpipe.runtime.model.tensor_parallel import TPGroup, shard_dim

def _rng_key(kind: str, rank: int) -> str:
    return f"rng.{kind}.rank{rank}"


def _rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    """CPU and (if any) accelerator generator states. Training draws no random numbers (no dropout;
    init and shuffle are seeded), so these matter only to code that adds randomness."""
    states = {"cpu": torch.get_rng_state()}
    if device.type != "cpu":
        module = torch.get_device_module(device.type)
        if hasattr(module, "get_rng_state"):
            states[device.type] = module.get_rng_state(device)
    return states


def _set_rng_states(states: dict[str, torch.Tensor], device: torch.device) -> None:
    for kind, state in states.items():
        if kind == "cpu":
            torch.set_rng_state(state)
        else:
            torch.get_device_module(device.type).set_rng_state(state, device)


def optimizer_states(module: nn.Module, optimizer: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Each parameter's AdamW state by name: torch's AdamW's live tensors, or a sharded optimizer's full states
    (``sharded_adamw.ShardedAdamW.full_states``: a collective over the holders, on the CPU)."""
    if hasattr(optimizer, "full_states"):
        return optimizer.full_states()
    states = {}
    for name, param in module.named_parameters():  # a tied weight is listed once
        state = optimizer.state[param]
        assert set(OPTIM_KINDS) <= set(state), f"no AdamW state for {name}: save only after an optimizer step"
        states[name] = state
    return states


def empty_states(module: nn.Module, device: torch.device | None, step_on_param: bool
                 ) -> dict[str, dict[str, torch.Tensor]]:
    """Zero AdamW states to load into, on ``device`` (None: each parameter's); ``step_on_param``: the step
    lives on the parameter's device (CUDA's fused AdamW)."""
    out = {}
    for name, param in module.named_parameters():
        where = param.device if device is None else device
        out[name] = {"step": torch.zeros((), dtype=torch.float32, device=param.device if step_on_param else "cpu"),
                     "exp_avg": torch.zeros(param.shape, dtype=param.dtype, device=where),
                     "exp_avg_sq": torch.zeros(param.shape, dtype=param.dtype, device=where)}
    return out


def rank_state(module: nn.Module, states: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Flat global-keyed state of this stage: the model's tensors and the AdamW ``states`` by parameter name."""
    flat: dict[str, torch.Tensor] = dict(module.state_dict())
    for name, _ in module.named_parameters():
        for kind in OPTIM_KINDS:
            flat[optim_key(kind, name)] = states[name][kind]
    return flat


def _sharded(key: str, tp: TPGroup | None) -> bool:
    """Whether a TP rank holds only a slice of this key's tensor (AdamW's scalar step never)."""
    return tp is not None and not key.startswith(optim_key("step", "")) and shard_dim(param_of_key(key)) is not None


def _saved_pieces(flat: dict[str, torch.Tensor], tp: TPGroup | None, writers: KeyWriters | None
                  ) -> dict[str, torch.Tensor]:
    """What this rank hands DCP's save: a TP rank's slices as DTensors at their offsets in the global tensors
    (tp_shards.py; nothing gathered, nothing global on any device), only for the keys its stage writes."""
    if tp is None:
        return flat
    assert writers is not None
    views = ShardViews(tp)
    return {key: views.wrap(value, param_of_key(key)) if _sharded(key, tp) else value
            for key, value in flat.items() if not _sharded(key, tp) or writers.writes(param_of_key(key))}


class CheckpointWriteError(RuntimeError):
    """A save failed on some rank (disk full, I/O error); raised on every rank, the last commit is intact."""


class _Writer(FileSystemWriter):
    """DCP's file writer with the test-only fault points of a save (fault_hooks)."""

    def __init__(self, path: str, step: int, rank: int, kill: KillSpec | None) -> None:
        super().__init__(path)
        self._step, self._rank, self._kill = step, rank, kill
        self.written: Future | None = None  # this rank's write results: which files it wrote

    def write_data(self, plan: Any, planner: Any) -> Future:  # type: ignore[override]
        maybe_enospc(self._step)
        written = self.written = super().write_data(plan, planner)
        if self._kill is not None:
            written.wait()  # this rank's shard is on disk; the metadata and the commit are not
            maybe_kill(self._kill, self._rank, "save", self._step)
        return written

    def files(self) -> list[str]:
        """The files this rank wrote (its shards; rank 0 also the metadata): known without listing the directory."""
        own = {r.storage_data.relative_path for r in (self.written.wait() if self.written is not None else [])}
        return sorted(own | ({DCP_METADATA} if self._rank == 0 else set()))


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    while exc is not None and exc not in out:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return out


def _disk_full(directory: Path) -> bool:
    try:
        return shutil.disk_usage(directory).free < 1 << 20
    except OSError:
        return False


def _root_cause(err: BaseException, directory: Path) -> str:
    """One line for a DCP failure: prefer a rank's OSError (ENOSPC, EIO) over wrappers such as
    torch.save's zip-writer RuntimeError, which hide the errno; say 'No space left on device'
    when the disk is full even if no rank's exception carries the errno."""
    failures = getattr(err, "failures", None)
    ranked = sorted(failures.items()) if isinstance(failures, dict) and failures else [(None, err)]
    # DCP keeps each rank's failure as (exception, traceback summary).
    chains = [(rank, _chain(exc[0] if isinstance(exc, tuple) else exc)) for rank, exc in ranked]
    where = next(((r, e) for r, chain in chains for e in chain if isinstance(e, OSError) and e.errno), None)
    rank, inner = where if where is not None else (chains[0][0], chains[0][1][0])
    text = str(inner).splitlines()[0] if str(inner) else ""
    if _disk_full(directory) and "No space left on device" not in text:
        text = f"No space left on device ({text})" if text else "No space left on device"
    return f"{'' if rank is None else f'rank {rank}: '}{type(inner).__name__}: {text}"


def save_checkpoint(root: str | Path, step: int, module: nn.Module, optimizer: Any, plan: Plan,
                    spec: ModelSpec, cursor: DataCursor, keep: int, device: torch.device,
                    extra: dict[str, Any] | None = None, group: dist.ProcessGroup | None = None) -> Path:
    """Collective over the world: every rank writes its shard, then rank 0 commits. Returns the checkpoint.
    ``group``: a gloo group over the world for DCP's and this function's object collectives (None: the
    default group), so on NCCL no pickle is staged in GPU memory."""
    root = Path(root)
    rank = dist.get_rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        remove_partial(root)  # leftovers of a killed save; nobody writes into them until the barrier
    dist.barrier(group=group)
    tmp = root / tmp_dir_name(step)
    tp = getattr(module, "tp", None)
    writers = KeyWriters(plan, rank, spec.tie_embeddings) if tp is not None else None
    flat = _saved_pieces(rank_state(module, optimizer_states(module, optimizer)), tp, writers)
    flat.update({_rng_key(kind, rank): s for kind, s in _rng_states(device).items()})
    writer = _Writer(str(tmp), step, rank, kill_spec())
    try:  # DCP gathers every rank's write outcome, so all ranks fail together
        dcp.save(flat, storage_writer=writer, process_group=group)  # after .metadata is written
    except (Exception, dcp.CheckpointException) as err:  # noqa: BLE001 - (DCP's is a BaseException)
        cause = _root_cause(err, root)  # before freeing the partial save's space: it tells a full disk
        dist.barrier(group=group)  # every rank has looked at the disk before rank 0 frees it
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # free the space the partial save took
        raise CheckpointWriteError(f"could not write checkpoint step {step} in '{root}' ({cause}); "
                                   "the previous checkpoint is intact: free space or fix the disk, then resume"
                                   ) from None
    if os.environ.get(FAIL_SAVE_ENV) == str(step):  # every rank alike: nobody waits in a collective
        raise InjectedSaveFailure(f"{FAIL_SAVE_ENV}={step}: simulated crash after the shards, before the commit")
    # O(1) file-system calls per rank: its own files (size, crc) and whether it sees rank 0's metadata.
    mine = {n: ((tmp / n).stat().st_size, crc32_file(tmp / n)) for n in writer.files()}
    report = (str(root), mine, missing(tmp, [DCP_METADATA]) if rank != 0 else [])

    def commit_on_rank0(reports: list[Any]) -> Any:
        """Rank 0: every rank's files visible here (O(world) lookups, on this rank only), then the commit."""
        writers = {n: r for r, (_, files, _) in enumerate(reports) for n in files}
        blind = [(0, missing(tmp, list(writers)))] + [(r, miss) for r, (_, _, miss) in enumerate(reports)]
        error = blind_error(reports[0][0], blind, writers)
        if error is not None:
            return error
        files = {n: info for _, part, _ in reports for n, info in part.items()}
        try:
            return str(commit(root, tmp, new_manifest(step, cursor, plan.to_dict(), spec, files, extra), keep))
        except OSError as err:
            return CheckpointWriteError(f"could not commit checkpoint step {step} in '{root}' ({err}); the "
                                        "previous checkpoint is intact: free space or fix the disk, then resume")

    outcome = settle_on_rank0(report, commit_on_rank0, group)
    if isinstance(outcome, SharedFilesystemError):  # node-local disks: every node holds a different part
        shutil.rmtree(tmp, ignore_errors=True)  # each rank's own view of the partial save
    if isinstance(outcome, Exception):
        raise outcome
    return Path(outcome)


def load_checkpoint(point: ResumePoint, module: nn.Module, optimizer: torch.optim.Optimizer | None,
                    device: torch.device, group: dist.ProcessGroup | None = None,
                    state_device: torch.device | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """Collective over the world: verify the files (split over ranks), then load this stage's keys
    (``group`` as in ``save_checkpoint``). The model's tensors load in place; the AdamW states go into
    ``optimizer`` if given, and are returned by parameter name (on ``state_device``, None: each parameter's,
    e.g. the CPU for a sharded optimizer that keeps only its pieces: ``ShardedAdamW.load_full``)."""
    assert point.step_dir is not None and point.manifest is not None
    step_dir, manifest = point.step_dir, point.manifest
    rank, world = dist.get_rank(), dist.get_world_size()
    fused = optimizer is not None and bool(optimizer.defaults.get("fused"))  # its step lives on the device
    states = empty_states(module, state_device, fused)
    flat = rank_state(module, states)
    # O(1) file-system calls per rank: the files it will read, and its stride of the crc checks.
    blind = missing(step_dir, [MANIFEST, DCP_METADATA])
    metadata = FileSystemReader(str(step_dir)).read_metadata() if not blind else None
    if metadata is not None:
        keys = {*flat, *(_rng_key(kind, rank) for kind in _rng_states(device))}
        blind = missing(step_dir, sorted({info.relative_path for index, info in metadata.storage_data.items()
                                          if index.fqn in keys}))
    # Every file is crc-checked by exactly one rank (its stride), so that rank must see it too.
    stride = [n for n in sorted(manifest.files)[rank::world] if n not in blind]
    unseen = missing(step_dir, stride)
    blind = sorted({*blind, *unseen})
    report = (str(step_dir.parent), blind, corrupt_files(step_dir, manifest, [n for n in stride if n not in unseen]))

    def verdict(reports: list[Any]) -> UserError | None:
        error = blind_error(reports[0][0], [(r, miss) for r, (_, miss, _) in enumerate(reports)])
        bad = sorted(name for _, _, corrupt in reports for name in corrupt)
        return error or (corrupt_error(step_dir, bad[0]) if bad else None)

    problem = settle_on_rank0(report, verdict, group)
    if problem is not None:
        raise problem  # every rank raises the same error
    assert metadata is not None
    saved = metadata.state_dict_metadata
    tp = getattr(module, "tp", None)
    if tp is not None:  # a TP rank reads its slices in place, by offset (tp_shards.py)
        views = ShardViews(tp)
        flat = {k: views.wrap(v, param_of_key(k)) if _sharded(k, tp) else v for k, v in flat.items()}
    rng = {kind: s.clone() for kind, s in _rng_states(device).items() if _rng_key(kind, rank) in saved}
    flat.update({_rng_key(kind, rank): s for kind, s in rng.items()})
    dcp.load(flat, storage_reader=FileSystemReader(str(step_dir)), process_group=group)
    if optimizer is not None:
        for name, param in module.named_parameters():
            optimizer.state[param] = states[name]
    _set_rng_states(rng, device)
    return states


def checkpoint_summary(path: str | Path) -> dict[str, Any]:
    """What ``ethpipe inspect`` shows: step, data cursor, model, plan shape, size (files checked, not read)."""
    step_dir = resolve_checkpoint(path)
    manifest = read_manifest(step_dir)
    check_files(step_dir, manifest)
    spec = spec_from_dict(manifest.model_spec)
    plan = manifest.plan
    pipelines = [{
        "depth": len(p["stages"]),
        "devices": [s["device"] for s in p["stages"]],
        "layers": [[list(r) for r in s["chunks"]] if "chunks" in s else [list(s["layers"])] for s in p["stages"]],
        "ranks": [list(s["ranks"]) for s in p["stages"]],
        "micro_batch_sizes": list(p["micro_batch_sizes"]),
    } for p in plan["pipelines"]]
    return {
        "path": str(step_dir), "step": manifest.step, "next_sample": manifest.cursor.next_sample,
        "shuffle": manifest.cursor.shuffle, "seed": manifest.cursor.seed,
        "model": spec.name, "num_params": spec.num_params(), "size_bytes": dir_size_bytes(step_dir),
        "num_files": len(manifest.files), "saved_at": manifest.saved_at, "torch_version": manifest.torch_version,
        "plan_method": plan.get("method"), "global_batch_size": plan.get("global_batch_size"),
        "seq_len": plan.get("seq_len"), "world_size": sum(len(r) for p in pipelines for r in p["ranks"]),
        "pipelines": pipelines, "plan": plan,
        "sublayers": int(plan.get("sublayers", 1)),  # the unit of the pipelines' layer ranges: 2 = half layers
        "checkpoints": [step for step, _ in complete_checkpoints(step_dir.parent)],
        "settings": manifest.extra.get("settings") or {},  # what the run trained with (runtime/start/run_settings.py)
        "shard_optimizer": bool(plan.get("shard_optimizer", False)),
    }
