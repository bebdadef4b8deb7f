"""A stage's random init drawn on several threads is bit-for-bit the one-thread draw (each parameter has its own
generator, seeded by its global name), for whole stages and tensor-parallel slices."""

from __future__ import annotations

import pytest
import torch

from ethpipe.model_spec import ModelSpec
from ethpipe.runtime.model import decoder
from ethpipe.runtime.model.tensor_parallel import TPGroup

SPEC = ModelSpec(name="init", num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_hidden_size=160,
                 vocab_size=96, max_seq_len=32)


@pytest.mark.parametrize("tp", [None, TPGroup(None, 1, 2)])
def test_threaded_init_is_the_sequential_draw(tp: TPGroup | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decoder, "init_threads", lambda: 4)
    threaded = decoder.build_stage(SPEC, (0, 3), True, True, seed=7, tp=tp)
    sequential = decoder.build_stage(SPEC, (0, 3), True, True, seed=7, tp=tp, init=False)
    full = decoder.state_dict_shapes(SPEC) if tp is not None else {}
    for name, param in sequential.named_parameters():
        decoder.init_parameter(SPEC, name, param, 7, full.get(name), sequential.tp)
    got = threaded.state_dict()
    assert all(torch.equal(got[k], v) for k, v in sequential.state_dict().items())


def test_init_threads_share_the_node_between_its_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decoder.os, "sched_getaffinity", lambda _: set(range(64)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert decoder.init_threads() == decoder.INIT_MAX_THREADS
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert decoder.init_threads() == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "128")
    assert decoder.init_threads() == 1
