"""Section 5: how eth's speedup moves with the speed ratio of two GPU types and with the network.

Speed ratio: 16 "fast" GPUs (A100-like: 312 TFLOPS, 80 GiB) and 16 "slow" ones with the same memory
and links and 1/ratio of the peak (inline GPU specs), so only the speed gap changes. Bandwidth: the
catalog's A100-80 + V100-32 (16 each) with every node's NIC set to the swept value.
"""

from __future__ import annotations

from typing import Any

from ethpipe.cluster import cluster_from_dict
from ethpipe.model_load import load_model_spec

from eval import scenarios as sc
from eval.common import BASELINES, METHODS, Job, run_method

TIE_TOLERANCE = 0.01  # a speedup within 1% of 1.0 counts as "no gain"


def speedups(methods: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """eth's simulated tokens/s over each baseline's; None where either plan is infeasible."""
    eth = methods["eth"]
    return {b: (eth["tokens_per_s"] / methods[b]["tokens_per_s"]
                if eth["feasible"] and methods[b]["feasible"] else None) for b in BASELINES}


def _point(sweep: str, x: float, spec_dict: dict[str, Any]) -> dict[str, Any]:
    model = sc.SENSITIVITY_MODEL
    cluster, spec = cluster_from_dict(spec_dict), load_model_spec(model.name)
    batch = sc.batch_for(model, cluster.num_devices)
    methods = {m: run_method(cluster, spec, batch, model.seq_len, m) for m in METHODS}
    return {"sweep": sweep, "x": x, "global_batch": batch, "seq_len": model.seq_len, "methods": methods,
            "speedup": speedups(methods)}


def jobs(quick: bool) -> list[Job]:
    ratios = sc.QUICK_SPEED_RATIOS if quick else sc.SPEED_RATIOS
    nics = sc.QUICK_NIC_GBIT_S if quick else sc.NIC_GBIT_S
    return ([Job(f"sensitivity ratio {r}", lambda r=r: _point("speed_ratio", r, sc.ratio_cluster_spec(r)))
             for r in ratios]
            + [Job(f"sensitivity NIC {n} Gbit/s", lambda n=n: _point("nic_gbit_s", n, sc.bandwidth_cluster_spec(n)))
               for n in nics])


def where_no_gain(points: list[dict[str, Any]], baseline: str) -> dict[str, Any]:
    """x values where eth gains less than the tolerance over ``baseline`` (or loses), and the extremes."""
    valid = [p for p in points if p["speedup"][baseline] is not None]
    if not valid:
        return {"no_gain_x": [], "loss_x": [], "min": None, "max": None}
    worst = min(valid, key=lambda p: p["speedup"][baseline])
    best = max(valid, key=lambda p: p["speedup"][baseline])
    return {"no_gain_x": [p["x"] for p in valid if p["speedup"][baseline] < 1.0 + TIE_TOLERANCE],
            "loss_x": [p["x"] for p in valid if p["speedup"][baseline] < 1.0 - TIE_TOLERANCE],
            "min": {"x": worst["x"], "speedup": worst["speedup"][baseline]},
            "max": {"x": best["x"], "speedup": best["speedup"][baseline]}}


def finish(rows: list[dict[str, Any]]) -> dict[str, Any]:
    sweeps: dict[str, Any] = {}
    for sweep in ("speed_ratio", "nic_gbit_s"):
        points = [r for r in rows if r["sweep"] == sweep]
        sweeps[sweep] = {"points": points, "analysis": {b: where_no_gain(points, b) for b in BASELINES}}
    return {"section": "sensitivity", "model": sc.SENSITIVITY_MODEL.name,
            "global_batch": sc.SENSITIVITY_MODEL.global_batch, "seq_len": sc.SENSITIVITY_MODEL.seq_len,
            "tie_tolerance": TIE_TOLERANCE,
            "fast_peak_tflops": sc.ratio_cluster_spec(1.0)["nodes"][0]["gpu"]["peak_tflops"],
            "figure": "figures/eval_sensitivity.png", "sweeps": sweeps}
