"""Aceso's per-op GPU profiles (Sailor artifact) as calibration observations (a converter; the data is not shipped).

Source: Sailor artifact, eth-easl/sailor commit cf2c8e3c, MIT licence, folder
``sailor/Planner/baselines/Aceso/profiler/<GPU>/profiled-data-{fp16,fp32}/``: the op CSVs
``OPT-{350,30}_mbs<b>_tp<t>_algo<a>.csv`` (times in microseconds). The CI checkout has the shared copy
beside the clone (``<repo>/../shared/reference/measured/sailor-aceso``); ``aceso_root`` returns None where
it is absent so callers can skip with a reason.

How the artifact measured (its ``op_profiler.py``): each Megatron op of ONE layer runs alone, 40 times
back to back after 10 warm-ups, then one ``torch.cuda.synchronize()`` and a host timestamp; ``--fp16``
for the fp16 folder, fp32 otherwise (TF32 on Ampere/Hopper: the fp32 GEMM rates exceed the CUDA-core
peak). So an op's time is its device time or its host issue time, whichever is longer. Ops are used
where their device time is the longer by construction (see Floors): they are priced as their kernels'
rooflines ``max(compute, memory)`` without ethpipe's launch floor and without the per-layer ``layer_s``
(one op, not a layer pass), so they inform the efficiencies, and ``launch_s`` / ``layer_s`` stay
what Sailor's layer passes fit.

Backward: the artifact's ``torch.autograd.grad(outputs, grad_outputs, inputs=<the op's input
activations>)`` computes the INPUT gradient only: a linear layer's backward here is its dgrad GEMM
(``dX = dY W^T``, the forward's FLOPs); the weight-gradient GEMM (``dW = X^T dY``) a training backward
also runs is not in it. So a backward op maps to ethpipe's ``<gemm>.dgrad`` kernel alone, never to the
``.wgrad`` one, and a training backward's wgrad is priced at the efficiency the forward and dgrad GEMMs
fit.

Floors: an op is used where its ideal time (every kernel at 100% of its roofline) is at least
``FWD_MIN_IDEAL_S`` forward, ``BWD_MIN_IDEAL_S`` backward. Below that the artifact's time is its host
side: the Python of one Megatron op and its launches, 50-100 us per op forward on these hosts and
``autograd.grad``'s 100-150 us per call backward, where ethpipe's ``launch_s`` is a floor per kernel of
a layer pass (fitted on Sailor's layer passes of the same machines). The two are different things:
fitted as one, the host-bound ops move ``launch_s`` towards the profiler's per-op host time and the
per-layer overhead with it, for no gain on the GEMMs (docs/benchmarks/calibration.md, "What each
choice of per-op data does", last row; ``observations(root, 0, 0, True)`` is that variant). Backward elementwise ops are not used: ethpipe
prices a whole block's backward elementwise traffic with ``ops.BWD_ELEMENTWISE_FACTOR`` (autograd's
extra passes in a full backward), which one op's input gradient does not pay.

Ops and the kernels of ``cost/ops.py`` they are priced as (fp16: Megatron's fused kernels; seq 2048,
TP 1 only, since TP > 1 ops include their all-reduces; the two TP partition variants ``algo0``/``algo1``
are the same computation at TP 1: the lower of their two times is taken, discarding a warm-up spike):

* ``enc-1st-layernorm``, ``enc-2nd-layernorm`` -> ``norm``; ``final-layernorm`` -> the head's ``final_norm``
* ``enc-attention-qkv`` -> ``qkv`` plus the three copies Megatron's ``split_tensor_along_last_dim(...,
  contiguous_split_chunks=True)`` makes of q, k, v (one read and one write of the fused output: work of
  Megatron's op that ethpipe's runtime does not do, so it is priced as the extra memory kernels it is)
* ``enc-attention-dense`` -> ``proj``; ``enc-MLP-GEMM-1`` -> ``fc1``; ``enc-MLP-GEMM-2`` -> ``fc2``
  (the artifact builds them with ``skip_bias_add=True``: the GEMM alone)
* ``enc-MLP-gelu`` -> ``act`` (Megatron's fused bias + GeLU)

Not used: the attention core (``enc-attention-score`` / ``-softmax`` / ``-context``: materialised
attention, which ethpipe's 16-bit plans never run on these GPUs, and whose batched GEMMs the roofline
cannot price from one memory efficiency), the dropouts (ethpipe's runs have none), the embedding and
``gpt-post-process`` (the head GEMM fused with the fp32 loss and its casts: DeepSpeed's first/last
modules are reported, not fitted, in the Sailor fit too), and failed ops (the artifact writes 1e7 us).
"""

from __future__ import annotations

import csv
import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ethpipe.catalog import get_gpu
from ethpipe.cost import calibrate as cal
from ethpipe.cost import ops
from ethpipe.cost.hardware import Calibration, DeviceCompute
from ethpipe.model_spec import ModelSpec

from sailor_data import GPU_IDS
from sailor_data import MODELS as SAILOR_MODELS

REPO_ROOT = Path(__file__).resolve().parents[1]
SOURCE = ("Sailor artifact, eth-easl/sailor commit cf2c8e3c, Aceso per-op profiles "
          "(sailor/Planner/baselines/Aceso/profiler/<GPU>/profiled-data-{fp16,fp32}/OPT-*_tp1_*.csv)")
SEQ_LEN = 2048
MICRO_BATCHES = (1, 2, 4, 8)
PRECISIONS = ("fp16", "fp32")
FAILED_US = 1e7  # the artifact's marker of an op that raised (out of memory)
FWD_MIN_IDEAL_S = 100e-6
BWD_MIN_IDEAL_S = 250e-6
# Aceso's model configs: the OPT shapes of Sailor's profiles, vocabulary 50272 (no padding to 50304).
MODELS = {name: dataclasses.replace(SAILOR_MODELS[name], name=f"aceso-{name.lower()}", vocab_size=50272)
          for name in ("OPT-350", "OPT-30")}
# Profiled op -> (layer kind, ethpipe kernel names in that layer's list, which occurrence).
FORWARD_OPS = {
    "enc-1st-layernorm": ("block", ("norm",), 0),
    "enc-2nd-layernorm": ("block", ("norm",), 1),
    "enc-attention-qkv": ("block", ("qkv",), 0),
    "enc-attention-dense": ("block", ("proj",), 0),
    "enc-MLP-GEMM-1": ("block", ("fc1",), 0),
    "enc-MLP-gelu": ("block", ("act",), 0),
    "enc-MLP-GEMM-2": ("block", ("fc2",), 0),
    "final-layernorm": ("head", ("final_norm",), 0),
}
BACKWARD_OPS = {  # the input gradient only: the dgrad GEMM of each linear layer
    "enc-attention-qkv": ("block", ("qkv.dgrad",), 0),
    "enc-attention-dense": ("block", ("proj.dgrad",), 0),
    "enc-MLP-GEMM-1": ("block", ("fc1.dgrad",), 0),
    "enc-MLP-GEMM-2": ("block", ("fc2.dgrad",), 0),
}
GEMM_OPS = ("enc-attention-qkv", "enc-attention-dense", "enc-MLP-GEMM-1", "enc-MLP-GEMM-2")


@dataclass(frozen=True)
class OpObservation:
    """One profiled op's timing, priced as ethpipe's kernels for it, and where it came from."""

    source: str  # "aceso" or "vidur"
    gpu_name: str  # the artifact's GPU name
    model: str  # the model it was measured on (leave-one-model-out holds out every source's rows of it)
    dtype: str  # "fp16" or "fp32"
    op: str  # the artifact's op name
    role: str  # "gemm" (a matrix op: informs the math unit's efficiency) or "mem" (elementwise)
    backward: bool
    size: int  # micro-batch (Aceso) or tokens (vidur)
    tp: int
    obs: cal.Observation


def aceso_root(repo_root: Path = REPO_ROOT) -> Path | None:
    root = Path(repo_root).parent / "shared" / "reference" / "measured" / "sailor-aceso"
    return root if root.is_dir() and any(root.glob("*/fp16/OPT-*_tp1_*.csv")) else None


def _read(path: Path) -> dict[str, tuple[float, float]]:
    with path.open() as f:
        return {r["op_name"]: (float(r["forward-compute"]), float(r["backward-compute"])) for r in csv.DictReader(f)}


def _times(root: Path, gpu: str, dtype: str, model: str, mbs: int) -> dict[str, tuple[float, float]]:
    """Per op (forward us, backward us) at TP 1: the lower of the two partition variants' times."""
    out: dict[str, list[float]] = {}
    for path in sorted((root / gpu / dtype).glob(f"{model}_mbs{mbs}_tp1_algo*.csv")):
        for op, times in _read(path).items():
            best = out.setdefault(op, [float("inf"), float("inf")])
            for i, t in enumerate(times):
                if 0 < t < FAILED_US:
                    best[i] = min(best[i], t)
    return {op: (f, b) for op, (f, b) in out.items()}


def _pick(kernels: list[ops.Kernel], names: tuple[str, ...], nth: int) -> list[ops.Kernel]:
    return [[k for k in kernels if k.name == n][nth] for n in names]


def _split_copies(spec: ModelSpec, mbs: int, e: int, backward: bool) -> list[ops.Kernel]:
    """Megatron's contiguous q/k/v split (forward: 3 copies; backward: their gradients gathered back)."""
    tokens = mbs * SEQ_LEN
    chunk = 2.0 * tokens * (spec.q_dim + 2 * spec.kv_dim) / 3 * e  # one read + one write of a third
    return [ops.mem("qkv.split", chunk)] * (1 if backward else 3)


def op_kernels(spec: ModelSpec, op: str, mbs: int, e: int, backward: bool) -> list[ops.Kernel]:
    kind, names, nth = (BACKWARD_OPS if backward else FORWARD_OPS)[op]
    kernels = _pick(ops.layer_kernels(kind, spec, SEQ_LEN, mbs, 1, e, "materialised", backward, code="megatron"),
                    names, nth)
    if op == "enc-attention-qkv":
        kernels += _split_copies(spec, mbs, e, backward)
    return kernels


def ideal_s(terms: tuple[tuple[int, float, float], ...]) -> float:
    """Every kernel at 100% of its roofline (peak and bandwidth), no floor."""
    return sum(max(c, m) for _, c, m in terms)


@lru_cache(maxsize=8)
def observations(root: Path, fwd_min_ideal_s: float = FWD_MIN_IDEAL_S, bwd_min_ideal_s: float = BWD_MIN_IDEAL_S,
                 launch_floor: bool = False) -> tuple[OpObservation, ...]:
    """Every usable op timing of every GPU, precision, model and micro-batch in ``root`` (TP 1); the floors
    and ``launch_floor`` as in the module's docstring (the arguments let the report show the alternative)."""
    out: list[OpObservation] = []
    for gpu_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        if gpu_dir.name not in GPU_IDS:
            continue
        gpu = get_gpu(GPU_IDS[gpu_dir.name])
        for dtype in PRECISIONS:
            if not (gpu_dir / dtype).is_dir():
                continue
            device = DeviceCompute.build(gpu, Calibration({}), dtype, True)
            e = 2 if dtype == "fp16" else 4
            for name, spec in MODELS.items():
                for mbs in MICRO_BATCHES:
                    times = _times(root, gpu_dir.name, dtype, name, mbs)
                    for backward, table in ((False, FORWARD_OPS), (True, BACKWARD_OPS)):
                        group = []  # this pass's ops: together they weigh as one measured layer pass
                        for op in table:
                            measured_us = times.get(op, (float("inf"),) * 2)[int(backward)]
                            if not measured_us < FAILED_US:
                                continue
                            terms = tuple(device.kernel_terms(op_kernels(spec, op, mbs, e, backward)))
                            if ideal_s(terms) < (bwd_min_ideal_s if backward else fwd_min_ideal_s):
                                continue
                            group.append((op, terms, measured_us * 1e-6))
                        for op, terms, measured in group:
                            o = cal.Observation(gpu.arch, gpu.id, spec.name, "op", backward, mbs, 1, measured, terms,
                                                0.0, layer_passes=0.0, launch_floor=launch_floor,
                                                weight=len(group) ** -0.5)
                            out.append(OpObservation("aceso", gpu_dir.name, name, dtype, op,
                                                     "gemm" if op in GEMM_OPS else "mem", backward, mbs, 1, o))
    return tuple(out)


if __name__ == "__main__":
    root = aceso_root()
    if root is None:
        raise SystemExit("shared Aceso profiles not found at ../shared/reference/measured/sailor-aceso")
    from collections import Counter

    for key, n in sorted(Counter((o.gpu_name, o.dtype, o.model) for o in observations(root)).items()):
        print(*key, n)
