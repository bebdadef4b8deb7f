"""One notation for a plan's pipelines wherever one is printed (`plan`, `simulate`, `demo`, `replan`, `inspect`).

A stage is ``device[ tpT] Llo-hi[*]``: its device type, its tensor-parallel degree where above 1, its layers as an
inclusive range (``L0-18`` is layers 0 through 18; an interleaved stage's chunks joined by ``+``), ``*`` where it
recomputes activations (a stage cut inside a layer: ``L7m-11a``, ``layers_text``). A pipeline is its stages joined
by ``->``. Identical pipelines (same stages, micro-batches
and schedule) are printed once, with the indices they cover: a 1024-GPU plan of 512 equal pipelines is one row.
"""

from __future__ import annotations

from collections.abc import Sequence

from ethpipe.plan import Pipeline, Plan, Stage


def layers_text(ranges: Sequence[tuple[int, int]], sublayers: int = 1) -> str:
    """[(0, 19)] -> 'L0-18'; [(5, 6)] -> 'L5'; chunks [(0, 7), (17, 23)] -> 'L0-6+L17-22'. In half layers
    (``sublayers`` 2) an end inside a layer says which half: [(15, 23)] -> 'L7m-11a' (layer 7's MLP through layer
    11's attention), [(14, 16)] -> 'L7', [(15, 16)] -> 'L7m'."""
    if sublayers == 1:
        return "+".join(f"L{lo}" if hi - lo == 1 else f"L{lo}-{hi - 1}" for lo, hi in ranges)
    out = []
    for lo, hi in ranges:
        start = f"{lo // 2}{'m' if lo % 2 else ''}"
        end = f"{(hi - 1) // 2}{'a' if hi % 2 else ''}"
        out.append(f"L{lo // 2}{'m' if lo % 2 else 'a' if hi - lo == 1 else ''}" if (hi - 1) // 2 == lo // 2
                   else f"L{start}-{end}")
    return "+".join(out)


def stage_text(stage: Stage) -> str:
    tp = f" tp{stage.tp}" if stage.tp > 1 else ""
    return f"{stage.device}{tp} {layers_text(stage.layer_ranges, stage.sublayers)}{'*' if stage.recompute else ''}"


def pipeline_text(pipe: Pipeline) -> str:
    return " -> ".join(stage_text(s) for s in pipe.stages)


def micro_batches_text(pipe: Pipeline) -> str:
    """'4 x b1', or ragged '3 (b2/1)'."""
    sizes = sorted(set(pipe.micro_batch_sizes), reverse=True)
    if len(sizes) == 1:
        return f"{pipe.num_microbatches} x b{sizes[0]}"
    return f"{pipe.num_microbatches} (b{'/'.join(map(str, sizes))})"


def _key(pipe: Pipeline) -> tuple:
    return (tuple((s.device, s.tp, s.layer_ranges, s.recompute) for s in pipe.stages), pipe.micro_batch_sizes,
            pipe.schedule)


def pipeline_groups(pipelines: Sequence[Pipeline]) -> list[tuple[list[int], Pipeline]]:
    """Runs of identical consecutive pipelines: (their indices, the first of them)."""
    groups: list[tuple[list[int], Pipeline]] = []
    for p, pipe in enumerate(pipelines):
        if groups and _key(groups[-1][1]) == _key(pipe):
            groups[-1][0].append(p)
        else:
            groups.append(([p], pipe))
    return groups


def plan_shape(plan: Plan) -> str:
    """The whole plan on one line: per group of identical pipelines, how many, their stages, samples each and
    micro-batches (the schedule where it is not 1F1B)."""
    parts = []
    for indices, pipe in pipeline_groups(plan.pipelines):
        count = f"{len(indices)} x " if len(indices) > 1 else ""
        schedule = f", {pipe.schedule}" if pipe.schedule != "1f1b" else ""
        parts.append(f"{count}[{pipeline_text(pipe)}] {pipe.num_samples} samples, {micro_batches_text(pipe)}"
                     f"{schedule}")
    return "; ".join(parts)
