import copy

import pytest

from ethpipe.plan import Block, Pipeline, Plan, Stage, compute_blocks

BASE = {
    "version": 1, "method": "eth", "model": "tiny", "global_batch_size": 10, "seq_len": 64,
    "pipelines": [
        {"stages": [{"ranks": [0], "device": "fast", "layers": [0, 3]},
                    {"ranks": [1], "device": "fast", "layers": [3, 8]}], "micro_batch_sizes": [4, 2]},
        {"stages": [{"ranks": [2], "device": "slow", "layers": [0, 5]},
                    {"ranks": [3], "device": "slow", "layers": [5, 8]}], "micro_batch_sizes": [4]},
    ],
    "blocks": [{"layers": [0, 3], "ranks": [0, 2]}, {"layers": [3, 5], "ranks": [1, 2]},
               {"layers": [5, 8], "ranks": [1, 3]}],
    "device_speeds": {"fast": 1.0, "slow": 0.5},
}


def test_round_trip_and_views(tmp_path) -> None:
    plan = Plan.from_dict(copy.deepcopy(BASE))
    assert plan.extra == {"device_speeds": {"fast": 1.0, "slow": 0.5}}
    assert plan.sample_offsets() == (0, 6) and plan.microbatch_slices(0) == ((0, 4), (4, 6))
    assert plan.blocks_of_stage(1, 0) == (0, 1)
    plan.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json") == plan


def test_blocks_are_common_refinement() -> None:
    a = Pipeline((Stage((0,), "x", (0, 2)), Stage((1,), "x", (2, 6))), (1,))
    b = Pipeline((Stage((2,), "x", (0, 4)), Stage((3,), "x", (4, 6))), (1,))
    c = Pipeline((Stage((4,), "x", (0, 6)),), (1,))
    assert compute_blocks([a, b, c]) == (
        Block((0, 2), (0, 2, 4)), Block((2, 4), (1, 2, 4)), Block((4, 6), (1, 3, 4)))


def _mutate(path: str, value):
    data = copy.deepcopy(BASE)
    target = data
    keys = path.split(".")
    for k in keys[:-1]:
        target = target[int(k)] if k.isdigit() else target[k]
    last = keys[-1]
    target[int(last) if last.isdigit() else last] = value
    return data


@pytest.mark.parametrize("path, value, message", [
    ("pipelines.1.stages.0.ranks", [1], "appears in both"),
    ("pipelines.1.stages.0.ranks", [7], "no gaps"),
    ("pipelines.0.stages.1.layers", [4, 8], "expected 3"),
    ("pipelines.0.stages.1.layers", [3, 7], "covers layers"),
    ("pipelines.0.micro_batch_sizes", [4, 3], "sum to 11"),
    ("blocks", [{"layers": [0, 8], "ranks": [0, 2]}], "common refinement"),
    ("pipelines.0.stages.0.tp", 2, "must match"),
    ("version", 9, "version"),
    ("global_batch_size", -3, "global_batch_size"),
])
def test_validation_errors(path, value, message) -> None:
    with pytest.raises(ValueError, match=message) as err:
        Plan.from_dict(_mutate(path, value))
    assert "\n" not in str(err.value)


INTERLEAVED = {  # pipeline 0 runs 2 chunks per stage: stage 0 holds [0, 2) and [4, 6), stage 1 [2, 4) and [6, 8)
    **BASE,
    "pipelines": [{"stages": [{"ranks": [0], "device": "fast", "chunks": [[0, 2], [4, 6]]},
                              {"ranks": [1], "device": "fast", "chunks": [[2, 4], [6, 8]]}],
                   "micro_batch_sizes": [2, 2, 1, 1], "schedule": "interleaved"},
                  BASE["pipelines"][1]],
    "global_batch_size": 10,
    "blocks": [{"layers": [0, 2], "ranks": [0, 2]}, {"layers": [2, 4], "ranks": [1, 2]},
               {"layers": [4, 5], "ranks": [0, 2]}, {"layers": [5, 6], "ranks": [0, 3]},
               {"layers": [6, 8], "ranks": [1, 3]}],
}


def test_interleaved_round_trip_and_chunk_views() -> None:
    plan = Plan.from_dict(copy.deepcopy(INTERLEAVED))
    pipe = plan.pipelines[0]
    assert pipe.num_chunks == 2 and pipe.stages[0].layers == (0, 2) and pipe.stages[0].num_layers == 4
    assert pipe.stages[1].chunk(1) == Stage((1,), "fast", (6, 8))
    assert pipe.boundaries == (2, 4, 6) and plan.blocks_of_stage(0, 0) == (0, 2, 3)
    assert compute_blocks(plan.pipelines) == plan.blocks
    assert plan.to_dict()["pipelines"][0]["stages"][1]["chunks"] == [[2, 4], [6, 8]]
    assert "layers" not in plan.to_dict()["pipelines"][0]["stages"][1]
    assert Plan.from_dict(plan.to_dict()) == plan


def _interleaved(**stage0) -> dict:
    data = copy.deepcopy(INTERLEAVED)
    data["pipelines"][0]["stages"][0] = {**data["pipelines"][0]["stages"][0], **stage0}
    return data


@pytest.mark.parametrize("data, message", [
    (_interleaved(layers=[0, 2]), r"stages\[0\]' has both 'layers' and 'chunks'"),
    (_interleaved(chunks=[[0, 2]]), r"stages\[0\].chunks' must list 2 or more"),
    (_interleaved(chunks=[[0, 2], [4, 6], [8, 8]]), r"chunks\[2\]' is empty"),
    (_interleaved(chunks=[[0, 2], [5, 6]]), r"stages\[0\].chunks\[1\]' starts at 5, expected 4"),
    ({**copy.deepcopy(INTERLEAVED), "pipelines": [{**INTERLEAVED["pipelines"][0], "schedule": "1f1b"},
                                                  INTERLEAVED["pipelines"][1]]}, "an 'interleaved' pipeline lists"),
    ({**copy.deepcopy(INTERLEAVED), "pipelines": [{**INTERLEAVED["pipelines"][0], "micro_batch_sizes": [2, 2, 2]},
                                                  INTERLEAVED["pipelines"][1]]},
     r"micro_batch_sizes' lists 3 micro-batches for an interleaved pipeline of 2 stages: use at most 2 or a multiple"),
])
def test_interleaved_validation_errors(data, message) -> None:
    with pytest.raises(ValueError, match=message) as err:
        Plan.from_dict(data)
    assert "\n" not in str(err.value)
