"""Calibration evidence: the per-kernel compute model against measured GPU profiles.

    python benchmarks/calibration.py [--write-shipped] [--global-batch 512]

Reads ``../shared/reference/measured``: ``sailor`` (Sailor artifact, eth-easl/sailor commit cf2c8e3c,
Megatron-DeepSpeed fp32 layer profiles), ``sailor-aceso`` (the same artifact's Aceso per-op profiles,
fp16 and fp32; benchmarks/aceso_data.py) and ``vidur`` (microsoft/vidur commit 7d475133, fp16 forward
per-op profiles; benchmarks/vidur_data.py), and writes docs/benchmarks/calibration.{md,json}: the
16-bit tensor-core efficiencies the per-op profiles fit, in-sample and leave-one-model-out errors per
family and precision (op timings) and of block / embedding / head times (layer passes), pairwise GPU
speed ratios, activation memory, and re-planned clusters. ``--write-shipped`` also refits
src/ethpipe/data/calibration.yaml on all the data (the constants ethpipe ships). Without the per-op
folders the fit is the layer passes' alone (as before they were added).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import aceso_data  # noqa: E402
import vidur_data  # noqa: E402
import zorse_data  # noqa: E402
import zorse_report  # noqa: E402
from aceso_data import OpObservation  # noqa: E402
from sailor_data import GPU_IDS, MODELS, SEQ_LEN, SOURCE, all_profiles, sailor_root  # noqa: E402

from ethpipe.catalog import get_gpu  # noqa: E402
from ethpipe.cluster import cluster_from_dict  # noqa: E402
from ethpipe.cost import calibrate as cal  # noqa: E402
from ethpipe.cost import links  # noqa: E402
from ethpipe.cost import memory  # noqa: E402
from ethpipe.cost.hardware import DEFAULT_CONSTANTS, Calibration, shipped_calibration  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "benchmarks"
CLUSTERS = {
    "8 A100-40 + 8 V100-16": [("A100-40", 8), ("V100-16", 8)],
    "16 A100-40 + 32 V100-16": [("A100-40", 16), ("V100-16", 32)],
    "8 A100-80 + 8 A100-40 + 16 V100-16": [("A100-80", 8), ("A100-40", 8), ("V100-16", 16)],
    "4 GH200 + 4 A100-40 + 8 RTX 3090 + 8 V100-16": [("GH-96", 4), ("A100-40", 4), ("RTX-3090", 8), ("V100-16", 8)],
}
REPLAN_GPN = {"A100-80": 8, "RTX-3090": 8}  # 4 GPUs per node otherwise (the issue's clusters)


LINK_CURVES_HEADER = (
    "# Intra-node NCCL send/recv bandwidth per GPU type and GPU count, written by benchmarks/calibration.py\n"
    "# --write-shipped. Source: Sailor artifact, eth-easl/sailor commit cf2c8e3c, providers/intra_node_bandwidths.json\n"
    "# (Sailor's quadratic fit: GB/s = c2 x^2 + c1 x + c0, x = log2(bytes / 1e6); max_gbps = highest measured).\n"
    "# Keys are ethpipe catalog ids; counts are GPUs communicating at once inside the node (cost/links.py).\n")


def link_curves_dict(root: Path) -> dict:
    """Sailor's intra-node curve constants in ethpipe's format (derived figures, source named)."""
    raw = json.loads((root / "network" / "intra_node_bandwidths.json").read_text())
    gpus = {GPU_IDS[name]: {int(n): {"c2": c2, "c1": c1, "c0": c0, "max_gbps": round(max_bps / 1e9, 3)}
                            for n, ((c2, c1, c0), max_bps) in sorted(counts.items(), key=lambda kv: int(kv[0]))}
            for name, counts in sorted(raw.items()) if name in GPU_IDS}
    return {"version": links.LINK_CURVES_VERSION,
            "source": "Sailor artifact, eth-easl/sailor commit cf2c8e3c, intra_node_bandwidths.json", "gpus": gpus}


def check_shipped_curves(root: Path) -> None:
    """The shipped curves are the artifact's (so the TP>1 rows and ethpipe plan price the same links)."""
    ours = links.link_curves_from_dict(link_curves_dict(root))
    if ours.curves != links.shipped_link_curves().curves:
        raise SystemExit("src/ethpipe/data/link_curves.yaml differs from the artifact: re-run with --write-shipped")


def observations(root: Path) -> dict[tuple[str, str, int], list[cal.Observation]]:
    """TP > 1 all-reduces priced by cal.shipped_link_gbps: the cost model's own curve code path."""
    return {(sp.model, sp.gpu, sp.profile.tp): cal.observations(sp.profile, get_gpu(GPU_IDS[sp.gpu]),
                                                                cal.shipped_link_gbps)
            for sp in all_profiles(root)}


def check_tp_code_path(root: Path) -> None:
    """Each TP>1 row's all-reduce time equals what CostModel prices for that stage (one code path)."""
    from ethpipe.cost.model import CostModel

    for sp in all_profiles(root):
        if sp.profile.tp <= 1:
            continue
        gpu = get_gpu(GPU_IDS[sp.gpu])
        clu = cluster_from_dict({"nodes": [{"gpu": gpu.id, "num_nodes": 1, "gpus_per_node": sp.profile.tp,
                                            "nic_gbit_s": 100}]})
        cost = CostModel(clu, MODELS[sp.model], SEQ_LEN[sp.model], dtype_bytes=4, dtype="fp32")
        for o in cal.observations(sp.profile, gpu, cal.shipped_link_gbps):
            if o.kind == "block":
                want = cal.TP_ALLREDUCES_PER_BLOCK_PASS * cost.tp_allreduce_s(gpu.id, o.tp, o.micro_batch)
                if not math.isclose(o.comm_s, want, rel_tol=1e-9):
                    raise SystemExit(f"TP>1 row {sp.model} {sp.gpu} tp{o.tp}: {o.comm_s} s != CostModel's {want} s")


def training_set(obs, exclude_model: str | None = None) -> list[cal.Observation]:
    """Fit on the lowest TP degree measured per (model, GPU) (least communication in the times), blocks and
    heads only: Sailor's layer 0 is DeepSpeed's first pipeline module, whose 0.2-1.4 ms is mostly work outside
    any kernel inventory (a fixed cost that does not scale with the micro-batch; its backward is not even
    captured), so fitting host constants to it would bend every block. Embeddings stay in the reports."""
    low: dict[tuple[str, str], int] = {}
    for m, g, t in obs:
        low[(m, g)] = min(low.get((m, g), t), t)
    return [o for (m, g, t), v in obs.items() if t == low[(m, g)] and m != exclude_model
            for o in v if o.kind != "embedding"]


def op_observations(repo: Path = REPO) -> tuple[OpObservation, ...]:
    """The per-op profiles' observations (Aceso fp16 + fp32, vidur fp16); empty where the folders are absent."""
    out: list[OpObservation] = []
    if (root := aceso_data.aceso_root(repo)) is not None:
        out += aceso_data.observations(root)
    if (root := vidur_data.vidur_root(repo)) is not None:
        out += vidur_data.observations(root)
    return tuple(out)


_ZORSE: list[tuple[zorse_data.ZorsePoint, ...]] = []


def zorse_points(repo: Path = REPO) -> tuple[zorse_data.ZorsePoint, ...]:
    """Zorse's 16-bit layer timings (benchmarks/zorse_data.py), read once; empty where the folder is absent."""
    if not _ZORSE:
        root = zorse_data.zorse_root(repo)
        _ZORSE.append(tuple(zorse_data.points(root)) if root is not None else ())
    return _ZORSE[0]


def sources(op_obs: tuple[OpObservation, ...]) -> str:
    names = {o.source for o in op_obs}
    return "; ".join([SOURCE, *([aceso_data.SOURCE] if "aceso" in names else []),
                      *([vidur_data.SOURCE] if "vidur" in names else []),
                      *([zorse_data.SOURCE] if zorse_points() else [])])


def combined_training_set(obs, exclude_model: str | None = None,
                          op_obs: tuple[OpObservation, ...] | None = None,
                          exclude_gpu: str | None = None) -> list[cal.Observation]:
    """The layer passes of ``training_set``, every per-op observation and Zorse's 16-bit layers, without the
    held-out model's (one name per model across the sources: Sailor's LLAMA-3-8 and vidur's Meta-Llama-3-8B are
    held out together) and without the held-out GPU's (catalog id)."""
    op_obs = op_observations() if op_obs is None else op_obs
    every = (training_set(obs, exclude_model) + [o.obs for o in op_obs if o.model != exclude_model]
             + [p.obs for p in zorse_points() if p.model != exclude_model])
    return [o for o in every if o.gpu != exclude_gpu]


def model_names(op_obs: tuple[OpObservation, ...]) -> list[str]:
    """Every model leave-one-model-out holds out: Sailor's three and the other sources' others."""
    others = {o.model for o in op_obs} | {p.model for p in zorse_points()}
    return [*MODELS, *sorted(others - set(MODELS))]


def lomo_fits(obs, op_obs: tuple[OpObservation, ...], select=None) -> dict[str, Calibration]:
    """Constants fitted without each model in turn (``select`` filters the per-op observations used)."""
    ops_used = op_obs if select is None else tuple(o for o in op_obs if select(o))
    return {m: cal.fit(combined_training_set(obs, m, ops_used)) for m in model_names(op_obs)}


def _row(o: cal.Observation, model: str, gpu: str, calibration: Calibration) -> dict:
    pred = o.predict_with(calibration)
    return {"model": model, "gpu": gpu, "tp": o.tp, "mbs": o.micro_batch, "kind": o.kind,
            "pass": "bwd" if o.backward else "fwd", "measured_ms": 1e3 * o.measured_s, "predicted_ms": 1e3 * pred,
            "error": (pred - o.measured_s) / o.measured_s}


def error_rows(obs, lomo: bool, fits: dict[str, Calibration] | None = None) -> list[dict]:
    """Layer-pass errors of every Sailor profile: constants fitted on everything (``lomo`` False) or without
    the row's model (per-op profiles of it included)."""
    if fits is None:
        op_obs = op_observations()
        if lomo:
            fits = {m: cal.fit(combined_training_set(obs, m, op_obs)) for m in MODELS}
        else:
            fits = dict.fromkeys(MODELS, cal.fit(combined_training_set(obs, None, op_obs)))
    rows = []
    for (m, g, _), group in sorted(obs.items()):
        rows += [_row(o, m, g, fits[m]) for o in group]
    return rows


def op_error_rows(op_obs: tuple[OpObservation, ...], fits: dict[str, Calibration] | Calibration) -> list[dict]:
    """Each op timing against its prediction (``fits``: one calibration, or one per held-out model); 16-bit
    GEMMs also at the 70% default (the same constants, tensor_eff replaced)."""
    rows = []
    for o in op_obs:
        calibration = fits if isinstance(fits, Calibration) else fits[o.model]
        c = calibration.constants(o.obs.arch)[0]
        pred = o.obs.predict_with(calibration)
        row = {"source": o.source, "gpu": o.gpu_name, "family": o.obs.arch, "model": o.model, "dtype": o.dtype,
               "op": o.op, "role": o.role, "pass": "bwd" if o.backward else "fwd", "size": o.size, "tp": o.tp,
               "measured_us": 1e6 * o.obs.measured_s, "predicted_us": 1e6 * pred, "weight": o.obs.weight,
               "error": pred / o.obs.measured_s - 1}
        if o.dtype == "fp16" and o.role == "gemm":
            default = dataclasses.replace(c, tensor_eff=DEFAULT_CONSTANTS.tensor_eff)
            row["error_at_default"] = o.obs.predict_s(default) / o.obs.measured_s - 1  # no measurement at all
        rows.append(row)
    return rows


def _wrms(rows: list[dict], key: str = "error") -> float:
    """Weighted root-mean-square relative error, each row weighted as in the fit."""
    w = sum(r["weight"] ** 2 for r in rows)
    return math.sqrt(sum(r["weight"] ** 2 * r[key] ** 2 for r in rows) / w) if w else float("nan")


def op_summary(rows: list[dict]) -> dict[str, dict]:
    """Per family, precision and kind of op (GEMM / elementwise): n, median and worst abs error, weighted RMS."""
    out = {}
    for key in sorted({(r["family"], r["dtype"], r["role"]) for r in rows}):
        sel = [r for r in rows if (r["family"], r["dtype"], r["role"]) == key]
        errs = [abs(r["error"]) for r in sel]
        worst = max(sel, key=lambda r: abs(r["error"]))
        out[" ".join(key)] = {"n": len(sel), "median": statistics.median(errs), "worst": max(errs), "wrms": _wrms(sel),
                              "worst_at": f"{worst['source']} {worst['gpu']} {worst['model']} {worst['op']} "
                                          f"{worst['pass']} {worst['size']} tp{worst['tp']}"}
    return out


def tensor_vs_default(rows: list[dict]) -> dict[str, dict]:
    """16-bit GEMM op errors with the fitted constants and with tensor_eff at the 70% default, per family and per
    (source, GPU) within it."""
    out = {}
    gemm = [r for r in rows if "error_at_default" in r]
    for fam in sorted({r["family"] for r in gemm}):
        sel = [r for r in gemm if r["family"] == fam]
        cells = {}
        for cell in sorted({(r["source"], r["gpu"]) for r in sel}):
            mine = [r for r in sel if (r["source"], r["gpu"]) == cell]
            cells[" ".join(cell)] = {
                "n": len(mine), "signed": statistics.median(r["error"] for r in mine),
                "median": statistics.median(abs(r["error"]) for r in mine),
                "signed_default": statistics.median(r["error_at_default"] for r in mine),
                "median_default": statistics.median(abs(r["error_at_default"]) for r in mine)}
        out[fam] = {"n": len(sel), "median": statistics.median(abs(r["error"]) for r in sel),
                    "median_default": statistics.median(abs(r["error_at_default"]) for r in sel),
                    "wrms": _wrms(sel), "wrms_default": _wrms(sel, "error_at_default"),
                    "gpu_balanced": statistics.mean(c["median"] for c in cells.values()),
                    "gpu_balanced_default": statistics.mean(c["median_default"] for c in cells.values()),
                    "cells": cells}
    return out


LARGE_GEMM_S = 500e-6  # ideal time of a GEMM op big enough to be compute-bound on every GPU here


def large_gemm_efficiency(op_obs: tuple[OpObservation, ...]) -> list[dict]:
    """What each GPU's large GEMM ops reach of the catalog's peak (FLOPs at peak / measured time), per source and
    precision: the spread a family's one constant has to span."""
    out = []
    keys = sorted({(o.obs.arch, o.source, o.gpu_name, o.dtype) for o in op_obs})
    for fam, source, gpu, dtype in keys:
        effs = [sum(c for _, c, _ in o.obs.terms) / o.obs.measured_s for o in op_obs
                if (o.obs.arch, o.source, o.gpu_name, o.dtype) == (fam, source, gpu, dtype) and o.role == "gemm"
                and all(c > 0 for _, c, _ in o.obs.terms) and sum(c for _, c, _ in o.obs.terms) >= LARGE_GEMM_S]
        if effs:
            out.append({"family": fam, "source": source, "gpu": gpu, "dtype": dtype, "n": len(effs),
                        "median": statistics.median(effs), "low": min(effs), "high": max(effs)})
    return out


def block_lomo(obs, fits: dict[str, Calibration]) -> dict[str, tuple[float, float]]:
    """Median and worst abs error of Sailor's TP-1 block passes, each model predicted without its data."""
    out = {}
    for backward in (False, True):
        errs = [abs(o.predict_with(fits[m]) / o.measured_s - 1)
                for (m, _, tp), group in obs.items() if tp == 1 for o in group
                if o.kind == "block" and o.backward == backward]
        out["bwd" if backward else "fwd"] = (statistics.median(errs), max(errs))
    return out


def variant_rows(obs, op_obs: tuple[OpObservation, ...], shipped: dict[str, Calibration],
                 shipped_full: Calibration) -> list[dict]:
    """The fit with less (or other) per-op data than the shipped one: what each choice does."""
    tiny: tuple[OpObservation, ...] = ()
    if (root := aceso_data.aceso_root(REPO)) is not None:
        tiny = tuple(o for o in aceso_data.observations(root, 0.0, 0.0, True))
    with_tiny = tuple(o for o in op_obs if o.source != "aceso") + tiny
    variants = [
        ("Sailor layer passes only (the previous release)", op_obs, lambda o: False),
        ("+ 16-bit GEMM ops", op_obs, lambda o: o.dtype == "fp16" and o.role == "gemm"),
        ("+ 16-bit ops (GEMM and elementwise)", op_obs, lambda o: o.dtype == "fp16"),
        ("+ 16-bit and fp32 ops (shipped)", op_obs, None),
        ("shipped, with Aceso's host-bound ops and the launch floor on its ops", with_tiny, None),
    ]
    out = []
    for label, pool, select in variants:
        if select is None and pool is op_obs:
            fits, full = shipped, shipped_full
        else:
            used = pool if select is None else tuple(o for o in pool if select(o))
            full = cal.fit(combined_training_set(obs, None, used))
            fits = {m: cal.fit(combined_training_set(obs, m, used)) for m in model_names(op_obs)}
        rows = op_error_rows(op_obs, fits)
        fp16 = [r for r in rows if r["dtype"] == "fp16" and r["role"] == "gemm"]
        fp32 = [r for r in rows if r["dtype"] == "fp32" and r["role"] == "gemm"]
        amp = full.architectures["ampere"]
        out.append({"variant": label, "tensor_eff": {a: c.tensor_eff for a, c in sorted(full.architectures.items())},
                    "ampere": {"tf32_eff": amp.tf32_eff, "mem_eff": amp.mem_eff, "launch_s": amp.launch_s,
                               "layer_s": amp.layer_s},
                    "block_lomo": block_lomo(obs, fits), "fp16_gemm_lomo_wrms": _wrms(fp16),
                    "fp32_gemm_lomo_wrms": _wrms(fp32)})
    return out


def summarise(rows: list[dict]) -> dict[str, dict]:
    out = {}
    for key in sorted({(r["kind"], r["pass"], r["tp"] == 1) for r in rows}):
        sel = [abs(r["error"]) for r in rows if (r["kind"], r["pass"], r["tp"] == 1) == key]
        worst = max((r for r in rows if (r["kind"], r["pass"], r["tp"] == 1) == key), key=lambda r: abs(r["error"]))
        out[f"{key[0]} {key[1]} {'tp=1' if key[2] else 'tp>1'}"] = {
            "n": len(sel), "median": statistics.median(sel), "worst": max(sel),
            "worst_at": f"{worst['model']} {worst['gpu']} tp{worst['tp']} mbs{worst['mbs']}"}
    return out


def ratio_rows(rows: list[dict], seen: dict[str, set[str]] | None = None) -> list[dict]:
    """Block fwd+bwd speed ratio between GPU types at the same (model, mbs, tp=1); ``seen[model]`` = the GPUs
    the fit that predicts ``model`` had data of (leave-one-model-out: measured on another model)."""
    times: dict[tuple[str, str, int], list[float]] = {}
    for r in rows:
        if r["kind"] == "block" and r["tp"] == 1:
            t = times.setdefault((r["model"], r["gpu"], r["mbs"]), [0.0, 0.0])
            t[0] += r["measured_ms"]
            t[1] += r["predicted_ms"]
    out = []
    for (m, ga, b), (ma, pa) in sorted(times.items()):
        for (m2, gb, b2), (mb, pb) in sorted(times.items()):
            if m2 == m and b2 == b and ga < gb:
                meas, pred = mb / ma, pb / pa
                unseen = [g for g in (gb, ga) if seen is not None and g not in seen[m]]
                out.append({"model": m, "mbs": b, "pair": f"{gb} / {ga}", "measured": meas, "predicted": pred,
                            "error": pred / meas - 1, "unmeasured_in_fit": unseen})
    return out


def memory_rows(root: Path) -> list[dict]:
    info = json.loads((root / "llm_info.json").read_text())
    out = []
    for name, spec in MODELS.items():
        for tp, layers in sorted(info.get(name, {}).items(), key=lambda kv: int(kv[0])):
            ends = [k for k in layers if int(k) > spec.num_layers]
            s = SEQ_LEN[name]
            for kind, measured, pred in (
                ("block", layers["2"]["act_mem_bytes"], memory.block_activation_bytes_materialised(spec, s, 4, int(tp))),
                ("head", sum(layers[k]["act_mem_bytes"] for k in ends),
                 memory.head_activation_bytes_materialised(spec, s, 4, int(tp))),
                ("block, flash formula", layers["2"]["act_mem_bytes"], memory.block_activation_bytes(spec, s, 4, int(tp))),
            ):
                out.append({"model": name, "tp": int(tp), "kind": kind, "measured_mb": measured / 1e6,
                            "predicted_mb": pred / 1e6, "error": pred / measured - 1})
    return out


def _cluster(groups: list[tuple[str, int]], root: Path) -> dict:
    nodes = []
    for name, count in groups:
        gpn = REPLAN_GPN.get(name, 4)
        gpu = get_gpu(GPU_IDS[name])
        nodes.append({"gpu": gpu.id, "num_nodes": max(1, count // gpn), "gpus_per_node": min(gpn, count),
                      "nic_gbit_s": 100})  # intra-node links: the shipped measured curves
    return {"nodes": nodes}


def replan_rows(root: Path, calibration: Calibration, global_batch: int) -> list[dict]:
    from ethpipe.cost.model import CostModel
    from ethpipe.planner import make_plan
    from ethpipe.planner.robust import resplit
    from ethpipe.sim import simulate

    measured = {GPU_IDS[sp.gpu]: sp.profile for sp in all_profiles(root) if sp.model == "OPT-350" and sp.profile.tp == 1}
    spec = MODELS["OPT-350"]
    out = []
    for label, groups in CLUSTERS.items():
        clu = cluster_from_dict(_cluster(groups, root))
        profs = {t: measured[t] for t in clu.gpu_types}
        t0 = time.perf_counter()
        # Priced as the profiled runtime runs (Megatron-DeepSpeed's kernels, its unfused fp32 attention, no distributed
        # optimizer): the plans are then judged under those profiles on equal terms, and what differs between
        # them is the compute model alone (sharding and the schedule are planner choices that would add
        # near-ties to flip; Megatron-DeepSpeed ran 1F1B).
        ours = make_plan(clu, spec, global_batch, 2048, "eth", max_tp=1, dtype="fp32", calibration=calibration,
                         attention="materialised", shard_optimizer=False, schedules=("1f1b",), layer_code="megatron")
        ref = make_plan(clu, spec, global_batch, 2048, "eth", max_tp=1, dtype="fp32", profiles=profs,
                        attention="materialised", shard_optimizer=False, schedules=("1f1b",), layer_code="megatron")
        measured_cost = CostModel.for_plan(ours, profiles=profs)
        ours_meas = simulate(ours, measured_cost).iteration_time_s
        # What `ethpipe train --rebalance` does online: re-split the batch from measured step times.
        rebalanced = simulate(resplit(ours, measured_cost), measured_cost).iteration_time_s
        ref_meas = simulate(ref, CostModel.for_plan(ref, profiles=profs)).iteration_time_s
        ours_pred = ours.predicted["iteration_time_s"]
        out.append({"cluster": label, "global_batch": global_batch, "calibrated_plan_predicted_s": ours_pred,
                    "calibrated_plan_under_profiles_s": ours_meas, "profile_plan_under_profiles_s": ref_meas,
                    "plan_quality": ours_meas / ref_meas - 1, "prediction_error": ours_pred / ours_meas - 1,
                    "rebalanced_under_profiles_s": rebalanced, "rebalanced_quality": rebalanced / ref_meas - 1,
                    "pipelines": [f"{'+'.join(s.device for s in p.stages)}:{p.num_samples}" for p in ours.pipelines],
                    "planning_s": time.perf_counter() - t0})
    return out


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def _pm(x: float) -> str:
    return f"{100 * x:.1f}%"


def _ops_report(data: dict) -> list[str]:
    ops_data = data["ops"]
    before, after = data["constants_before"], data["constants"]
    lines = [
        "## 16-bit tensor-core efficiency from per-op profiles", "",
        f"Sources: {aceso_data.SOURCE}; {vidur_data.SOURCE}. Each profiled op is priced as the kernel(s)",
        "`cost/ops.py` has for it (benchmarks/aceso_data.py, benchmarks/vidur_data.py: norms, the QKV, output",
        "projection and MLP GEMMs, activation, RoPE, residual add; Aceso's QKV op with the q/k/v split copies",
        "Megatron makes) on the catalog GPU (Aceso's GPUs as in the Sailor profiles; vidur's `a100` =",
        "a100_80gb_sxm, `h100` = h100_sxm, `a40` = a40), and each op timing is one more equation of the same fit",
        "as the layer passes: its kernels' rooflines `max(compute, memory)`, without the launch floor or the",
        "per-layer overhead. Only device-bound timings are used: Aceso's ops whose ideal time (every kernel at",
        f"100% of its roofline) is at least {1e6 * aceso_data.FWD_MIN_IDEAL_S:.0f} us forward / "
        f"{1e6 * aceso_data.BWD_MIN_IDEAL_S:.0f} us backward, above the",
        "profiler's host time per op (it issues 40 runs, then synchronises), at TP 1 (TP > 1 ops include their",
        "all-reduces), the lower of the two partition variants; vidur's device-timed ops of at least",
        f"{vidur_data.MIN_TOKENS} tokens (powers of two) and {1e6 * vidur_data.MIN_IDEAL_S:.0f} us ideal. "
        "Each op is weighted 1/sqrt(n) among the n ops of its",
        "measured pass, so that one pass of ops weighs as one layer pass. The fp16 GEMM ops fit `tensor_eff`;",
        "the fp32 ones (Aceso: TF32 on Ampere/Hopper, CUDA cores on Volta/Turing) join Sailor's layer passes in",
        "fitting `tf32_eff` / `simd_eff`, and the elementwise ones in `mem_eff`; `launch_s` and `layer_s` stay",
        "the layer passes' (the last row of \"What each choice does\" shows the alternative). 16-bit = fp16 here; bf16",
        "runs at the same tensor-core rate on Ampere and Hopper and is priced with the same constant.", "",
        "**Aceso's backward is the input gradient only** (`torch.autograd.grad(..., inputs=<the op's input",
        "activations>)`): a linear layer's backward there is its dgrad GEMM, without the weight-gradient GEMM a",
        "training backward also runs. So a backward op is priced as ethpipe's `.dgrad` kernel alone, never as",
        "the training backward; only backward GEMMs are used (one op's input gradient does not pay the",
        "elementwise backward traffic `BWD_ELEMENTWISE_FACTOR` prices in a whole block's backward); and a",
        "training backward's wgrad GEMM is priced at the efficiency the forward and dgrad GEMMs fit, since",
        "nothing here measures it. vidur is forward only (inference). Neither source times a fused attention",
        "kernel (vidur's attention.csv is not in the shared copy; Aceso's attention is materialised and not",
        "used): flash / memory-efficient attention is priced with the fitted `tensor_eff`, unmeasured.", "",
        "Leave-one-model-out (held out): each model is predicted by constants fitted without any source's data",
        "of it: " + ", ".join(MODELS) + " (Sailor, and Aceso for the OPTs; LLAMA-3-8 held out with",
        "vidur's Meta-Llama-3-8B), " + ", ".join(m for m in data["ops"]["models"] if m not in MODELS
                                                 and not m.startswith("zorse-")) + " (vidur), "
        + ", ".join(m for m in data["ops"]["models"] if m.startswith("zorse-")) + " (Zorse).",
        "", "### Fitted constants: layer passes only (before) and with the per-op profiles (shipped)", "",
        "`before` is today's fit of the layer passes alone (the previous release shipped these to within 0.2%).", "",
        "| family | 16-bit tensor eff | tf32 eff | simd eff | mem eff | launch us | layer us | fitted now |",
        "|---|---|---|---|---|---|---|---|"]
    fams = list(after["architectures"])
    for fam in [*fams, "fallback"]:
        a = after["fallback"] if fam == "fallback" else after["architectures"][fam]
        b = before["fallback"] if fam == "fallback" else before["architectures"].get(fam, before["fallback"])
        cell = [f"{b[k]:.3f} -> {a[k]:.3f}" for k in ("tensor_eff", "tf32_eff", "simd_eff", "mem_eff")]
        cell += [f"{1e6 * b[k]:.1f} -> {1e6 * a[k]:.1f}" for k in ("launch_s", "layer_s")]
        label = "fallback (centre: families nobody measured)" if fam == "fallback" else fam
        lines.append(f"| {label} | {' | '.join(cell)} | {', '.join(a['fitted'])} |")
    tvd_in, tvd = ops_data["tensor_vs_default_in_sample"], ops_data["tensor_vs_default_lomo"]
    lines += ["", "### 16-bit GEMM ops: the fitted tensor_eff against the 70% default", "",
              "Errors of the fp16 GEMM op timings with the fitted constants and with the same constants at",
              "`tensor_eff` = 0.70 (the value shipped before); held out: each model's ops predicted by the fit",
              "without it. `GPU-balanced` = the mean over the family's (source, GPU) of their median abs error",
              "(each GPU counts once, however many shapes it was timed at); `weighted RMS` weighs each op as the fit",
              "does (the fit's own loss).", "",
              "| family | tensor_eff (all data) | held-out fits | n | in-sample median: fitted / 70% | held-out median: "
              "fitted / 70% | held-out GPU-balanced: fitted / 70% | held-out weighted RMS: fitted / 70% |",
              "|---|---|---|---|---|---|---|---|"]
    for fam, v in tvd.items():
        lo, hi = ops_data["lomo_tensor_eff"][fam]
        i = tvd_in[fam]
        lines.append(f"| {fam} | {after['architectures'][fam]['tensor_eff']:.3f} | {lo:.3f}-{hi:.3f} | {v['n']} | "
                     f"{_pm(i['median'])} / {_pm(i['median_default'])} | {_pm(v['median'])} / {_pm(v['median_default'])} "
                     f"| {_pm(v['gpu_balanced'])} / {_pm(v['gpu_balanced_default'])} | {_pm(v['wrms'])} / "
                     f"{_pm(v['wrms_default'])} |")
    wins = [f for f, v in tvd.items() if v["wrms"] < v["wrms_default"] and v["gpu_balanced"] < v["gpu_balanced_default"]]
    losses = [f for f in tvd if f not in wins]
    pooled = ops_data["lomo_fp16_gemm_pooled"]
    lines += ["", f"Held out, the fitted constants beat the 70% default on {', '.join(wins) or 'no family'} (both "
              f"GPU-balanced and weighted RMS){'' if not losses else '; not on ' + ', '.join(losses)}. Over every "
              f"held-out 16-bit GEMM op of every family: weighted RMS {_pm(pooled['wrms'])} fitted against "
              f"{_pm(pooled['wrms_default'])} at 70%, median {_pm(pooled['median'])} against "
              f"{_pm(pooled['median_default'])}. Why a family's one constant misses: its GPUs, and one GPU at "
              "different shapes, reach different fractions of the catalog's peak (large GEMM ops, ideal time >= "
              f"{1e6 * LARGE_GEMM_S:.0f} us):", "",
              "| family | source | GPU | precision | large GEMM ops | of catalog peak: median (range) | "
              "held-out signed median: fitted / 70% | held-out abs median: fitted / 70% |",
              "|---|---|---|---|---|---|---|---|"]
    for r in ops_data["large_gemm_efficiency"]:
        cell = tvd.get(r["family"], {}).get("cells", {}).get(f"{r['source']} {r['gpu']}") if r["dtype"] == "fp16" \
            else None
        tail = (f"{_pct(cell['signed'])} / {_pct(cell['signed_default'])} | {_pm(cell['median'])} / "
                f"{_pm(cell['median_default'])}") if cell else " | "
        lines.append(f"| {r['family']} | {r['source']} | {r['gpu']} | {r['dtype']} | {r['n']} | {r['median']:.2f} "
                     f"({r['low']:.2f}-{r['high']:.2f}) | {tail} |")
    lines += ["", "The GeForce cards (RTX 3090, RTX 2080 Ti) run their GEMMs above the catalog's peak, whose",
              "fp32-accumulate figures assume the datasheet boost clock (they boost higher), so no efficiency up to",
              "1 reaches them; within a GPU, smaller GEMMs (OPT-350's, vidur's TP 8 shards) reach less than large",
              "ones, which a roofline with one efficiency per unit does not model. Held out, the fitted constant of a",
              "family measured on two models (Volta, Turing: OPT-350 and OPT-30 only) is the other model's, small",
              "GEMMs' for large ones and the reverse.", "",
              "### Op timings per family and precision", "",
              "| family | precision | ops | n | in-sample median / worst | held-out median / worst | held-out weighted "
              "RMS | held-out worst at |", "|---|---|---|---|---|---|---|---|"]
    ins, out = ops_data["summary_in_sample"], ops_data["summary_lomo"]
    for k, v in out.items():
        fam, dtype, role = k.split()
        i = ins[k]
        lines.append(f"| {fam} | {dtype} | {'GEMM' if role == 'gemm' else 'elementwise'} | {v['n']} | "
                     f"{_pm(i['median'])} / {_pm(i['worst'])} | {_pm(v['median'])} / {_pm(v['worst'])} | {_pm(v['wrms'])} "
                     f"| {v['worst_at']} |")
    lines += ["", "Elementwise ops miss by more than GEMMs: one memory efficiency per family prices every streaming",
              "kernel, and these range from ~0.3 (vidur's RMSNorm) to ~0.9 (its residual add) of the bandwidth.", "",
              "### What each choice of per-op data does", "",
              "Each row is a fit on Sailor's layer passes plus the per-op observations named; block columns: Sailor's",
              "TP-1 block passes held out (median / worst); GEMM columns: the per-op timings held out (weighted RMS).",
              "", "| fit | tensor_eff ampere / hopper / turing / volta | Ampere tf32 / mem eff, launch / layer us | "
              "block fwd | block bwd | fp16 GEMM ops | fp32 GEMM ops |", "|---|---|---|---|---|---|---|"]
    for r in ops_data["variants"]:
        t = " / ".join(f"{r['tensor_eff'].get(f, float('nan')):.3f}" for f in ("ampere", "hopper", "turing", "volta"))
        a = r["ampere"]
        bf, bb = r["block_lomo"]["fwd"], r["block_lomo"]["bwd"]
        lines.append(f"| {r['variant']} | {t} | {a['tf32_eff']:.3f} / {a['mem_eff']:.3f}, {1e6 * a['launch_s']:.0f} / "
                     f"{1e6 * a['layer_s']:.0f} | {_pm(bf[0])} / {_pm(bf[1])} | {_pm(bb[0])} / {_pm(bb[1])} | "
                     f"{_pm(r['fp16_gemm_lomo_wrms'])} | {_pm(r['fp32_gemm_lomo_wrms'])} |")
    lines += ["", "The fp32 op timings are kept: they improve the held-out fp32 GEMMs and Sailor's held-out blocks",
              "(median), so `tf32_eff` and `simd_eff` are now fitted on Sailor's layer passes and Aceso's fp32 ops",
              "together. Aceso's host-bound ops (ideal time below the floors above), fitted with the launch floor,",
              "pull `launch_s` towards the profiler's per-op host time and the per-layer overhead up with it (last",
              "row) for no gain on the GEMMs: that host time belongs to one profiled op called alone, not to a",
              "kernel of a layer pass, so they are left out.", ""]
    return lines


def write_report(data: dict, path: Path) -> None:
    lines = [
        "# Compute model vs measured GPU profiles (generated)",
        "",
        f"Sources: {data['source']}. Generated by `python benchmarks/calibration.py` from the shared copies of",
        "the artifacts (no measured numbers are stored in the repository except the ones below). The model: each",
        "kernel of a layer or op (`cost/ops.py`) takes max(compute, memory, launch) on the GPU's datasheet peaks",
        "times its family's constants, plus a per-layer overhead (`cost/hardware.py`); the constants are a",
        "maximum a posteriori fit of every family at once, each near a common centre that prices families",
        "nobody measured (`cost/calibrate.py`), to Sailor's layer passes and the per-op profiles together.",
        "`error` = predicted / measured - 1.",
        "",
    ]
    if data.get("zorse"):
        lines += zorse_report.section(data["zorse"])
    if data.get("ops"):
        lines += _ops_report(data)
    lines += [
        "## Layer passes (Sailor, fp32)", "",
        "Times are one layer pass for one micro-batch on one TP rank, the layer's kernels priced as Megatron's",
        "unfused fp32 attention (as measured). Fits use block and head passes at the lowest TP degree measured",
        "per (model, GPU); embeddings (DeepSpeed's first pipeline module, mostly non-kernel work) are reported,",
        "not fitted. TP > 1 rows add Megatron's all-reduces priced on Sailor's intra-node NCCL curves through the",
        "cost model's own code path (`cost/links.py`, shipped `data/link_curves.yaml`; the script checks each",
        "TP > 1 block row against `CostModel.tp_allreduce_s`). OPT-30 and LLaMA on A100-40 are treated as TF32",
        "off and V100-16 as the SXM2 part (see benchmarks/sailor_data.py).",
        "",
    ]
    for title, key in (("In-sample (fitted on all models)", "in_sample"),
                       ("Leave-one-model-out (each model predicted by constants fitted on the others)", "lomo")):
        lines += [f"## {title}", "", "| layer pass | n | median abs error | worst | worst at |", "|---|---|---|---|---|"]
        for k, v in data[key]["summary"].items():
            lines.append(f"| {k} | {v['n']} | {100 * v['median']:.1f}% | {100 * v['worst']:.1f}% | {v['worst_at']} |")
        lines.append("")
    lines += ["## Leave-one-model-out block times at TP 1 (fwd / bwd, ms)", "",
              "| model | GPU | mbs | measured | predicted | error |", "|---|---|---|---|---|---|"]
    rows = [r for r in data["lomo"]["rows"] if r["kind"] == "block" and r["tp"] == 1]
    for r in rows:
        if r["pass"] == "fwd":
            b = next(x for x in rows if x["pass"] == "bwd" and (x["model"], x["gpu"], x["mbs"]) == (r["model"], r["gpu"], r["mbs"]))
            lines.append(f"| {r['model']} | {r['gpu']} | {r['mbs']} | {r['measured_ms']:.2f} / {b['measured_ms']:.2f} | "
                         f"{r['predicted_ms']:.2f} / {b['predicted_ms']:.2f} | {_pct(r['error'])} / {_pct(b['error'])} |")
    ratios = data["lomo"]["ratios"]
    within = sum(abs(r["error"]) <= 0.10 for r in ratios)
    missed = [r for r in ratios if abs(r["error"]) > 0.10]
    blind = sum(bool(r["unmeasured_in_fit"]) for r in missed)
    in_within = sum(abs(r["error"]) <= 0.10 for r in data["in_sample"]["ratios"])
    lines += ["", f"## Speed ratios between GPU types (block fwd+bwd, TP 1, leave-one-model-out): {within} of "
              f"{len(ratios)} within 10%", "",
              f"In-sample (constants fitted on all the data) {in_within} of {len(data['in_sample']['ratios'])} "
              f"are within 10%. Of the {len(missed)} held-out misses, {blind} involve a GPU that the fit predicting "
              "them had no measurement of (`unmeasured`: its only profiles, layer or op, are of the held-out model, so "
              "it is priced by its family's or the centre's constants).", "",
              "| model | mbs | pair | measured | predicted | error | unmeasured in the fit |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['mbs']} | {r['pair']} | {r['measured']:.2f} | {r['predicted']:.2f} | {_pct(r['error'])} "
              f"| {', '.join(r['unmeasured_in_fit'])} |" for r in ratios]
    lines += ["", "## Activation memory per layer and sample (llm_info.json, micro-batch 1)", "",
              "| model | tp | kind | measured MB | predicted MB | error |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['tp']} | {r['kind']} | {r['measured_mb']:.1f} | {r['predicted_mb']:.1f} | {_pct(r['error'])} |"
              for r in data["memory"]]
    lines += ["", "## Re-planned clusters (OPT-350, fp32, sequence 2048, 100 Gbit/s NICs, tp 1)", "",
              "`calibrated plan` = `ethpipe plan` with the shipped constants and no profiles; `under profiles` = the",
              "simulator pricing it with the measured profiles (`ethpipe simulate --profile`); `profile plan` = the plan",
              "made from the measured profiles themselves; `after re-split` = the calibrated plan with its batch",
              "re-split across its pipelines from the measured speeds (what `ethpipe train --rebalance` does online;",
              "layers stay where the calibrated model put them).", "",
              "| cluster | batch | calibrated plan predicted s | its time under profiles s | profile plan s | plan quality | "
              "prediction error | after re-split s | quality after re-split |",
              "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['cluster']} | {r['global_batch']} | {r['calibrated_plan_predicted_s']:.3f} | "
              f"{r['calibrated_plan_under_profiles_s']:.3f} | {r['profile_plan_under_profiles_s']:.3f} | "
              f"{_pct(r['plan_quality'])} | {_pct(r['prediction_error'])} | {r['rebalanced_under_profiles_s']:.3f} | "
              f"{_pct(r['rebalanced_quality'])} |" for r in data["replan"]]
    lines += ["", "## Fitted constants (all data; shipped in src/ethpipe/data/calibration.yaml)", "",
              "| architecture | 16-bit tensor eff | tf32 eff | simd eff | mem eff | launch us | layer us | fitted |",
              "|---|---|---|---|---|---|---|---|"]
    families = list(data["constants"]["architectures"].items())
    if data["constants"].get("fallback"):
        families.append(("fallback (centre: families nobody measured)", data["constants"]["fallback"]))
    for arch, c in families:
        lines.append(f"| {arch} | {c['tensor_eff']:.3f} | {c['tf32_eff']:.3f} | {c['simd_eff']:.3f} | {c['mem_eff']:.3f} | "
                     f"{1e6 * c['launch_s']:.1f} | {1e6 * c['layer_s']:.0f} | {', '.join(c['fitted'])} |")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write-shipped", action="store_true")
    ap.add_argument("--global-batch", type=int, default=512)
    args = ap.parse_args()
    root = sailor_root(REPO)
    if root is None:
        raise SystemExit("shared Sailor data not found at ../shared/reference/measured/sailor: nothing to do")
    if args.write_shipped:
        (REPO / "src/ethpipe/data/link_curves.yaml").write_text(
            LINK_CURVES_HEADER + yaml.safe_dump(link_curves_dict(root), sort_keys=False))
        links.shipped_link_curves.cache_clear()
    check_shipped_curves(root)
    obs = observations(root)
    op_obs = op_observations()
    if args.write_shipped and {o.source for o in op_obs} != {"aceso", "vidur"}:
        raise SystemExit("--write-shipped fits the per-op profiles too: ../shared/reference/measured/sailor-aceso "
                         "and .../vidur not found")
    source = sources(op_obs)
    before = cal.fit(training_set(obs), source=SOURCE)  # the layer passes alone: what shipped before
    constants = cal.fit(combined_training_set(obs, None, op_obs), source=source)
    if args.write_shipped:
        header = ("# Compute-model constants per GPU architecture family, fitted by benchmarks/calibration.py --write-shipped\n"
                  f"# Sources: {SOURCE} (profiles/*/*/profile.json; TP 1, or the lowest TP measured: layer passes);\n"
                  f"# {aceso_data.SOURCE};\n# {vidur_data.SOURCE};\n# {zorse_data.SOURCE}.\n"
                  "# Derived figures only: the measured files stay in the shared copies (docs/benchmarks/calibration.md).\n"
                  "# tensor_eff / tf32_eff / simd_eff: fraction of the datasheet bf16-fp16 / TF32 / CUDA-core fp32 peak\n"
                  "# that large GEMMs reach: tensor_eff fitted to the fp16 GEMM ops (Aceso forward and input-gradient\n"
                  "# dgrad GEMMs, vidur forward), tf32_eff / simd_eff to the fp32 layer passes and Aceso's fp32 ops;\n"
                  "# mem_eff: fraction of datasheet memory bandwidth (layer passes and elementwise ops); launch_s: least\n"
                  "# time of a kernel and layer_s per layer pass (layer passes only; cost/hardware.py: a kernel takes\n"
                  "# max(compute, memory, launch)). A family's `fitted` lists the constants its data inform (the others\n"
                  "# sit at the fit's centre); `fallback` is that centre, which prices families nobody measured (ada,\n"
                  "# pascal, cdna, ...; `ethpipe plan` says so). `gpus`: each measured GPU type's compute factor around\n"
                  "# its family (power caps, clocks) and the fit's median |error| on its own data.\n")
        (REPO / "src/ethpipe/data/calibration.yaml").write_text(header + yaml.safe_dump(constants.to_dict(), sort_keys=False))
        shipped_calibration.cache_clear()
    check_tp_code_path(root)
    fits = lomo_fits(obs, op_obs)
    in_rows = error_rows(obs, False, dict.fromkeys(MODELS, constants))
    lomo_rows = error_rows(obs, True, {m: fits[m] for m in MODELS})
    seen = {m: {o.gpu for o in combined_training_set(obs, m, op_obs)} for m in MODELS}
    seen = {m: {name for name, gid in GPU_IDS.items() if gid in ids} for m, ids in seen.items()}
    data = {"source": source, "constants": constants.to_dict(), "constants_before": before.to_dict(),
            "in_sample": {"summary": summarise(in_rows), "rows": in_rows, "ratios": ratio_rows(in_rows)},
            "lomo": {"summary": summarise(lomo_rows), "rows": lomo_rows, "ratios": ratio_rows(lomo_rows, seen)},
            "memory": memory_rows(root), "replan": replan_rows(root, constants, args.global_batch)}
    if zorse_points():
        data["zorse"] = zorse_report.evaluate(
            lambda m, g: combined_training_set(obs, m, op_obs, g), zorse_points(), constants)
    if op_obs:
        op_in, op_lomo = op_error_rows(op_obs, constants), op_error_rows(op_obs, fits)
        lomo_gemm = [r for r in op_lomo if "error_at_default" in r]
        data["ops"] = {
            "models": model_names(op_obs),
            "summary_in_sample": op_summary(op_in), "summary_lomo": op_summary(op_lomo),
            "tensor_vs_default_in_sample": tensor_vs_default(op_in), "tensor_vs_default_lomo": tensor_vs_default(op_lomo),
            "lomo_fp16_gemm_pooled": {
                "n": len(lomo_gemm), "wrms": _wrms(lomo_gemm), "wrms_default": _wrms(lomo_gemm, "error_at_default"),
                "median": statistics.median(abs(r["error"]) for r in lomo_gemm),
                "median_default": statistics.median(abs(r["error_at_default"]) for r in lomo_gemm)},
            "lomo_tensor_eff": {f: (min(c.architectures[f].tensor_eff for c in fits.values() if f in c.architectures),
                                    max(c.architectures[f].tensor_eff for c in fits.values() if f in c.architectures))
                                for f in constants.architectures},
            "large_gemm_efficiency": large_gemm_efficiency(op_obs),
            "variants": variant_rows(obs, op_obs, fits, constants)}
    OUT.mkdir(parents=True, exist_ok=True)
    derived = {**data, "in_sample": {"summary": data["in_sample"]["summary"],  # figures we derive, not the data
                                     "ratios": data["in_sample"]["ratios"]},
               "lomo": {"summary": data["lomo"]["summary"], "ratios": data["lomo"]["ratios"]}}
    (OUT / "calibration.json").write_text(json.dumps(derived, indent=1) + "\n")
    write_report(data, OUT / "calibration.md")
    for fam, c in constants.architectures.items():
        was = before.architectures.get(fam, before.fallback)
        print(f"{fam}: tensor_eff {c.tensor_eff:.3f} (before {was.tensor_eff if was else float('nan'):.3f}), "
              f"tf32 {c.tf32_eff:.3f}, simd {c.simd_eff:.3f}, mem {c.mem_eff:.3f}")
    for k, v in data.get("ops", {}).get("summary_lomo", {}).items():
        print(f"LOMO ops {k}: n {v['n']} median {100 * v['median']:.1f}% worst {100 * v['worst']:.1f}%")
    for k, v in data["lomo"]["summary"].items():
        print(f"LOMO {k}: median {100 * v['median']:.1f}% worst {100 * v['worst']:.1f}%")
    for r in data["replan"]:
        print(r["cluster"], f"quality {_pct(r['plan_quality'])} (after re-split {_pct(r['rebalanced_quality'])}) "
              f"prediction {_pct(r['prediction_error'])}")


if __name__ == "__main__":
    main()
