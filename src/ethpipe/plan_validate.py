"""Parse and validate a Plan from JSON data, with one clear message per problem.

Kept apart from ``plan.py`` so the data types stay short; every check here names the field
and what to do, because hand-edited plans are a supported input.
"""

from __future__ import annotations

from typing import Any

from ethpipe.cost.memory import GRAD_REDUCE_CHOICES
from ethpipe.cost.ops import ATTENTION_CHOICES, LAYER_CODES
from ethpipe.errors import UserError
from ethpipe.model_spec import ModelSpec, spec_from_dict
from ethpipe.schedule import DEFAULT_SCHEDULE, SCHEDULES, interleaved_fits
from ethpipe.plan_parts import PLAN_VERSION, Block, IdleDevice, Pipeline, Stage, compute_blocks
from ethpipe.sublayers import SUBLAYER_CHOICES

_KNOWN = {"version", "method", "model", "global_batch_size", "seq_len", "pipelines", "blocks",
          "model_spec", "cluster", "predicted", "idle_devices", "shard_optimizer", "shard_weights", "sublayers"}


def _req(data: dict[str, Any], key: str, where: str) -> Any:
    if key not in data:
        raise UserError(f"plan field '{where}{key}' is missing")
    return data[key]


def _pos_int(value: Any, where: str, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if allow_zero else 1):
        kind = "a non-negative" if allow_zero else "a positive"
        raise UserError(f"plan field '{where}' must be {kind} integer, got {value!r}")
    return value


def _stage(data: Any, where: str, sublayers: int) -> Stage:
    if not isinstance(data, dict):
        raise UserError(f"plan field '{where}' must be an object with ranks, device, layers")
    ranks = _req(data, "ranks", where + ".")
    if not isinstance(ranks, list) or not ranks:
        raise UserError(f"plan field '{where}.ranks' must be a non-empty list of ranks")
    ranks_t = tuple(_pos_int(r, f"{where}.ranks", allow_zero=True) for r in ranks)
    if "chunks" in data:
        if "layers" in data:
            raise UserError(f"plan field '{where}' has both 'layers' and 'chunks': an interleaved stage lists its "
                            "chunks' ranges only")
        raw = data["chunks"]
        if not isinstance(raw, list) or len(raw) < 2:
            raise UserError(f"plan field '{where}.chunks' must list 2 or more [start, end) ranges")
        chunks = tuple(_range(r, f"{where}.chunks[{c}]") for c, r in enumerate(raw))
    else:
        chunks = (_range(_req(data, "layers", where + "."), f"{where}.layers"),)
    tp = _pos_int(data.get("tp", 1), f"{where}.tp")
    if tp != len(ranks_t):
        raise UserError(f"plan field '{where}.tp' is {tp} but the stage lists {len(ranks_t)} ranks: they must match")
    device = data.get("device", "cpu")
    if not isinstance(device, str):
        raise UserError(f"plan field '{where}.device' must be a GPU type id string")
    return Stage(ranks_t, device, chunks[0], tp, bool(data.get("recompute", False)), chunks if len(chunks) > 1 else (),
                 sublayers)


def _range(layers: Any, where: str) -> tuple[int, int]:
    if not (isinstance(layers, list) and len(layers) == 2):
        raise UserError(f"plan field '{where}' must be [start, end)")
    lo, hi = (_pos_int(x, where, allow_zero=True) for x in layers)
    if hi <= lo:
        raise UserError(f"plan field '{where}' is empty ([{lo}, {hi})): every stage needs at least one layer")
    return lo, hi


def _pipeline(data: Any, where: str, sublayers: int) -> Pipeline:
    if not isinstance(data, dict):
        raise UserError(f"plan field '{where}' must be an object with stages and micro_batch_sizes")
    stages = _req(data, "stages", where + ".")
    if not isinstance(stages, list) or not stages:
        raise UserError(f"plan field '{where}.stages' must be a non-empty list")
    parsed = tuple(_stage(s, f"{where}.stages[{i}]", sublayers) for i, s in enumerate(stages))
    mbs = _req(data, "micro_batch_sizes", where + ".")
    if not isinstance(mbs, list) or not mbs:
        raise UserError(f"plan field '{where}.micro_batch_sizes' must be a non-empty list of sizes")
    sizes = tuple(_pos_int(b, f"{where}.micro_batch_sizes") for b in mbs)
    schedule = data.get("schedule", DEFAULT_SCHEDULE)
    if schedule not in SCHEDULES:
        raise UserError(f"plan field '{where}.schedule' must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    chunks = {len(st.layer_ranges) for st in parsed}
    if len(chunks) > 1:
        raise UserError(f"plan field '{where}.stages' mix stages of {' and '.join(map(str, sorted(chunks)))} chunks: "
                        "every stage of an interleaved pipeline holds the same number")
    if (schedule == "interleaved") != (chunks != {1}):
        raise UserError(f"plan field '{where}.schedule' is {schedule!r} but its stages hold {chunks.pop()} chunk(s): "
                        "an 'interleaved' pipeline lists 'chunks' per stage, any other lists 'layers'")
    if schedule == "interleaved" and len(parsed) < 2:
        raise UserError(f"plan field '{where}.schedule' is 'interleaved' on a single stage: use '1f1b'")
    if schedule == "interleaved" and not interleaved_fits(len(parsed), len(sizes)):
        raise UserError(f"plan field '{where}.micro_batch_sizes' lists {len(sizes)} micro-batches for an interleaved "
                        f"pipeline of {len(parsed)} stages: use at most {len(parsed)} or a multiple of {len(parsed)}, "
                        "or schedule '1f1b'")
    return Pipeline(parsed, sizes, schedule)


def _check_layers(pipes: tuple[Pipeline, ...], num_layers: int, sublayers: int) -> None:
    """Each pipeline's stages tile the model's ``num_layers`` x ``sublayers`` units."""
    unit = "layers" if sublayers == 1 else "half layers"
    num_layers *= sublayers
    for p_idx, pipe in enumerate(pipes):
        expect = 0
        for c in range(pipe.num_chunks):  # virtual-stage order: chunk 0 of every stage, then chunk 1, ...
            for s_idx, stage in enumerate(pipe.stages):
                lo, hi = stage.layer_ranges[c]
                field = "layers" if pipe.num_chunks == 1 else f"chunks[{c}]"
                if lo != expect:
                    raise UserError(
                        f"plan field 'pipelines[{p_idx}].stages[{s_idx}].{field}' starts at {lo}, expected {expect}: "
                        f"stages (chunk by chunk when interleaved) must tile [0, {num_layers}) without gaps or overlaps"
                    )
                expect = hi
        if expect != num_layers:
            raise UserError(
                f"plan field 'pipelines[{p_idx}]' covers {unit} [0, {expect}) but the model has {num_layers} {unit}"
            )


def _check_ranks(pipes: tuple[Pipeline, ...]) -> None:
    seen: dict[int, str] = {}
    for p_idx, pipe in enumerate(pipes):
        for s_idx, stage in enumerate(pipe.stages):
            for r in stage.ranks:
                here = f"pipelines[{p_idx}].stages[{s_idx}]"
                if r in seen:
                    raise UserError(f"plan rank {r} appears in both {seen[r]} and {here}: each rank runs one stage")
                seen[r] = here
    world = len(seen)
    missing = sorted(set(range(world)) - set(seen))
    if missing:
        raise UserError(f"plan ranks must be 0..{world - 1} with no gaps: rank {missing[0]} is missing")


def _idle_devices(raw: Any, cluster: Any, pipes: tuple[Pipeline, ...]) -> tuple[IdleDevice, ...]:
    """``idle_devices`` against the plan's cluster: the other devices, in cluster order, are ranks 0..world-1."""
    from ethpipe.cluster import cluster_from_dict

    usage = "a list of {device_index, device, reason}"
    if not isinstance(raw, list):
        raise UserError(f"plan field 'idle_devices' must be {usage}, got {type(raw).__name__}")
    if not raw:
        return ()
    if cluster is None:
        raise UserError("plan field 'idle_devices' needs the plan's 'cluster' (device_index counts its devices): "
                        "add the cluster or drop idle_devices")
    try:
        devices = cluster_from_dict(cluster).devices
    except UserError as err:
        raise UserError(f"plan field 'cluster' is invalid: {err}") from None
    out: list[IdleDevice] = []
    for i, entry in enumerate(raw):
        where = f"idle_devices[{i}]"
        if not isinstance(entry, dict):
            raise UserError(f"plan field '{where}' must be an object with device_index, device, reason")
        index = _req(entry, "device_index", where + ".")
        if isinstance(index, bool) or not isinstance(index, int):
            raise UserError(f"plan field '{where}.device_index' must be an integer (the device's index in the "
                            f"cluster's device order), got {index!r}")
        if not 0 <= index < len(devices):
            raise UserError(f"plan field '{where}.device_index' is {index} but the cluster has {len(devices)} "
                            f"devices: use an index in 0..{len(devices) - 1}")
        if index in {d.device_index for d in out}:
            raise UserError(f"plan field '{where}.device_index' {index} is listed twice: list each idle device once")
        device = _req(entry, "device", where + ".")
        if device != devices[index].gpu.id:
            raise UserError(f"plan field '{where}.device' is {device!r} but cluster device {index} is a "
                            f"'{devices[index].gpu.id}': fix the device_index or the device")
        reason = _req(entry, "reason", where + ".")
        if not isinstance(reason, str) or not reason.strip():
            raise UserError(f"plan field '{where}.reason' must be a non-empty string saying why the device is idle")
        out.append(IdleDevice(index, device, reason))
    idle = {d.device_index for d in out}
    active = [d for d in devices if d.rank not in idle]
    world = sum(len(p.ranks) for p in pipes)
    if world != len(active):
        raise UserError(f"plan field 'idle_devices' leaves {len(active)} of the cluster's {len(devices)} devices "
                        f"active but the pipelines use {world} ranks: give every active device one rank, or list "
                        "the unused ones in idle_devices")
    for p_idx, pipe in enumerate(pipes):
        for s_idx, stage in enumerate(pipe.stages):
            for r in stage.ranks:
                if stage.device != active[r].gpu.id:
                    raise UserError(f"plan field 'pipelines[{p_idx}].stages[{s_idx}].device' is '{stage.device}' "
                                    f"but rank {r} is cluster device {active[r].rank}, a '{active[r].gpu.id}' "
                                    "(ranks number the non-idle devices in cluster order): fix the device or "
                                    "idle_devices")
    return tuple(out)


def check_tp(pipes: tuple[Pipeline, ...], spec: ModelSpec) -> None:
    """Every stage's tensor-parallel degree must split the model evenly (the planner emits no other)."""
    for p_idx, pipe in enumerate(pipes):
        for s_idx, stage in enumerate(pipe.stages):
            problem = spec.tp_problem(stage.tp)
            if problem is not None:
                raise UserError(f"plan field 'pipelines[{p_idx}].stages[{s_idx}].tp' is {stage.tp} but model "
                                f"'{spec.name}' cannot be split so: {problem}; use a smaller tp")


def plan_fields(data: Any) -> dict[str, Any]:
    """The Plan's fields from its JSON form, each checked (``Plan.from_dict`` builds the Plan from them)."""
    if not isinstance(data, dict):
        raise UserError("plan must be a JSON object")
    version = _req(data, "version", "")
    if version != PLAN_VERSION:
        raise UserError(f"plan field 'version' is {version!r}; this ethpipe reads version {PLAN_VERSION}")
    model = _req(data, "model", "")
    if not isinstance(model, str):
        raise UserError("plan field 'model' must be a preset name or a spec path")
    spec: ModelSpec | None = None
    if "model_spec" in data:
        spec = spec_from_dict(data["model_spec"])
    batch = _pos_int(_req(data, "global_batch_size", ""), "global_batch_size")
    seq_len = _pos_int(_req(data, "seq_len", ""), "seq_len")
    raw_pipes = _req(data, "pipelines", "")
    if not isinstance(raw_pipes, list) or not raw_pipes:
        raise UserError("plan field 'pipelines' must be a non-empty list")
    sublayers = data.get("sublayers", 1)
    if sublayers not in SUBLAYER_CHOICES or isinstance(sublayers, bool):
        raise UserError(f"plan field 'sublayers' must be 1 (layer ranges count layers) or 2 (they count half layers), "
                        f"got {sublayers!r}")
    pipes = tuple(_pipeline(p, f"pipelines[{i}]", sublayers) for i, p in enumerate(raw_pipes))
    num_layers = pipes[0].stages[-1].layer_ranges[-1][1] // sublayers
    if spec is None:
        try:
            from ethpipe.model_load import load_model_spec

            num_layers = load_model_spec(model).num_layers
        except UserError:
            pass  # model resolved later by whoever needs it; layer tiling is still checked
    else:
        num_layers = spec.num_layers
    _check_layers(pipes, num_layers, sublayers)
    _check_ranks(pipes)
    if spec is not None:
        check_tp(pipes, spec)
    total = sum(p.num_samples for p in pipes)
    if total != batch:
        raise UserError(
            f"plan micro_batch_sizes sum to {total} samples but global_batch_size is {batch}: they must be equal"
        )
    expected = compute_blocks(pipes)
    raw_blocks = _req(data, "blocks", "")
    try:
        blocks = tuple(Block(tuple(b["layers"]), tuple(b["ranks"])) for b in raw_blocks)
    except (TypeError, KeyError):
        raise UserError("plan field 'blocks' must be a list of {layers: [lo, hi], ranks: [...]}") from None
    if blocks != expected:
        want = [list(b.layers) for b in expected]
        raise UserError(
            f"plan field 'blocks' is not the common refinement of the stage boundaries: expected layer ranges {want} "
            "with one holder per pipeline (regenerate with `ethpipe plan`)"
        )
    cluster = data.get("cluster")
    idle = _idle_devices(data.get("idle_devices", []), cluster, pipes)
    predicted = data.get("predicted")
    extra = {k: v for k, v in data.items() if k not in _KNOWN}
    if extra.get("attention", "auto") not in ATTENTION_CHOICES:
        raise UserError(f"plan field 'attention' must be one of {', '.join(ATTENTION_CHOICES)}, got "
                        f"{extra['attention']!r}: re-make the plan with `ethpipe plan --attention ...`")
    if extra.get("layer_code", "ethpipe") not in LAYER_CODES:
        raise UserError(f"plan field 'layer_code' must be one of {', '.join(LAYER_CODES)}, got "
                        f"{extra['layer_code']!r}: remove it to price ethpipe's own runtime")
    shard, weights = _sharding(data, sum(len(p.ranks) for p in pipes))
    reduce = extra.get("grad_reduce", "fp32")
    if reduce not in GRAD_REDUCE_CHOICES:
        raise UserError(f"plan field 'grad_reduce' must be one of {', '.join(GRAD_REDUCE_CHOICES)}, got {reduce!r}: "
                        "re-make the plan with `ethpipe plan --grad-reduce ...`")
    return {"method": str(data["method"]) if "method" in data else "custom", "model": model,
            "global_batch_size": batch, "seq_len": seq_len, "pipelines": pipes, "blocks": blocks, "model_spec": spec,
            "cluster": cluster, "predicted": predicted, "extra": extra, "version": version, "idle_devices": idle,
            "shard_optimizer": shard, "shard_weights": weights}


def _sharding(data: dict[str, Any], world_size: int) -> tuple[bool, tuple[float, ...]]:
    """``shard_optimizer`` (a bool) and ``shard_weights`` (one positive number per rank, or none)."""
    shard = data.get("shard_optimizer", False)
    if not isinstance(shard, bool):
        raise UserError(f"plan field 'shard_optimizer' must be true or false, got {shard!r}")
    raw = data.get("shard_weights", [])
    if not isinstance(raw, list) or any(isinstance(w, bool) or not isinstance(w, (int, float)) or w <= 0 for w in raw):
        raise UserError("plan field 'shard_weights' must be a list of positive numbers, one per rank")
    if raw and len(raw) != world_size:
        raise UserError(f"plan field 'shard_weights' has {len(raw)} entries but the plan has {world_size} ranks: "
                        "give one per rank, or drop it for equal shards")
    if raw and not shard:
        raise UserError("plan field 'shard_weights' needs 'shard_optimizer': true")
    return shard, tuple(float(w) for w in raw)
