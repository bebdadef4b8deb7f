"""16-bit layer prices per GPU type against Zorse's measurements: in-sample, leave-one-model-out, leave-one-GPU-out.

Called by benchmarks/calibration.py (its report's "16-bit layers per GPU type" section). Each error is
predicted / measured - 1 of one layer's forward or backward at one micro-batch (fp16 autocast over fp32
weights, kernel time; benchmarks/zorse_data.py). Leave one model out: the constants fitted without that model
(any source). Leave one GPU out: fitted without any of that GPU's data, so it is priced by its family's
constants and no factor of its own: what a user's GPU that nobody measured gets.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from ethpipe.catalog import gpu_catalog
from ethpipe.cost import calibrate as cal
from ethpipe.cost.hardware import Calibration
from zorse_data import ZorsePoint


MIN_SERIES = 4  # micro-batches a series needs for its drift: a trend, not two points


def _error(p: ZorsePoint, calibration: Calibration) -> float:
    return p.obs.predict_with(calibration) / p.obs.measured_s - 1


def per_gpu(points: tuple[ZorsePoint, ...], fit_for: Callable[[ZorsePoint], Calibration]) -> dict[str, dict]:
    """Per GPU: n, median |error|, the forward and backward median predicted / measured, micro-batch 1's, and the
    drift: per series (Zorse GPU key, model, sequence, pass; ``MIN_SERIES`` micro-batches or more) the error at its
    largest micro-batch less that at its smallest, the median over series. No priced term grows faster than the tokens at one sequence length (launch and per-layer
    costs grow slower), so a drift far below 0 is time growing faster than work: clocks that fall under a longer
    load, not a missing kernel."""
    out: dict[str, dict] = {}
    for gpu in sorted({p.gpu for p in points}):
        mine = [(p, _error(p, fit_for(p))) for p in points if p.gpu == gpu]
        series: dict[tuple, list[tuple[int, float]]] = {}
        for p, e in mine:
            series.setdefault((p.key, p.model, p.seq_len, p.obs.backward), []).append((p.obs.micro_batch, e))
        drift = [max(v)[1] - min(v)[1] for v in series.values() if len(v) >= MIN_SERIES]
        fwd = [1 + e for p, e in mine if not p.obs.backward]
        bwd = [1 + e for p, e in mine if p.obs.backward]
        bwd1 = [1 + e for p, e in mine if p.obs.backward and p.obs.micro_batch == 1]
        out[gpu] = {"n": len(mine), "median_abs": statistics.median(abs(e) for _, e in mine),
                    "fwd_ratio": statistics.median(fwd), "bwd_ratio": statistics.median(bwd),
                    "bwd_mb1_ratio": statistics.median(bwd1) if bwd1 else None,
                    "drift": statistics.median(drift) if drift else None}
    return out


def evaluate(training: Callable[[str | None, str | None], list[cal.Observation]], points: tuple[ZorsePoint, ...],
             shipped: Calibration, before: Calibration | None = None) -> dict:
    """``training(exclude_model, exclude_gpu)``: the fit's observations without them."""
    models = sorted({p.model for p in points})
    gpus = sorted({p.gpu for p in points})
    lomo = {m: cal.fit(training(m, None)) for m in models}
    logo = {g: cal.fit(training(None, g)) for g in gpus}
    out = {"in_sample": per_gpu(points, lambda p: shipped), "lomo": per_gpu(points, lambda p: lomo[p.model]),
           "logo": per_gpu(points, lambda p: logo[p.gpu])}
    if before is not None:
        out["before"] = per_gpu(points, lambda p: before)
    catalog = gpu_catalog()
    out["unmeasured"] = sorted(g for g, spec in catalog.items() if spec.arch and spec.vendor == "NVIDIA"
                               and shipped.compute_scale(g) == 1.0 and g not in shipped.gpus)
    out["factors"] = {g: {"compute_scale": f.compute_scale, "load_exponent": f.load_exponent, "n": f.num_observations,
                          "median_abs": f.median_abs_error} for g, f in sorted(shipped.gpus.items())}
    return out


def _r(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def section(data: dict) -> list[str]:
    lines = ["## 16-bit layers per GPU type (Zorse: fp16 autocast, kernel time)", "",
             "One decoder layer's forward and backward at micro-batch 1-16 (three Llama shapes, 512-4096 tokens;",
             "benchmarks/zorse_data.py says what was measured and what is used). `ratio` = predicted / measured",
             "(median over the GPU's points); `|error|` = median |predicted / measured - 1|. The backward includes the",
             "runtime's own per-micro-batch work (each gradient cast to fp32 and added into `.grad`, priced by",
             "`ops.grad_accumulation_kernels`); each measured GPU has its own compute factor around its family.",
             "Each point is priced as the layer the harness ran (`layer_code: hf`, cost/elementwise.py): transformers'",
             "eager Llama layer under plain autocast over an fp32 input, whose fp32 residual stream, unfused fp32",
             "RMSNorm, per-projection input casts and `rotate_half` RoPE move 3-4x the bytes of fused kernels",
             "(counted: tests/unit/test_counted_elementwise.py). Priced with the fused inventory instead (commit",
             "f2e3e3c), leave-one-model-out median |error| was: A100-40 14.9%, A100-80 11.1%, A10G 12.3%, H100 NVL",
             "16.5%, L4 9.5%, P100 9.0%, P40 11.4%, RTX A6000 8.7%, T4 14.8%, V100-PCIe 9.2%, V100-SXM2 10.7%: the",
             "unpriced elementwise work made small layers look slow and large ones fast to every fit.",
             "`drift` (in-sample): per series (one model, sequence length and pass, 4 or more micro-batches) the",
             "error at its largest micro-batch less at its smallest, median. No priced work term grows faster than",
             "the tokens at one sequence length (launch and per-layer costs grow slower), so a drift well below 0 is",
             "a card whose time grows faster than its work. Priced at full clocks, the two cards the PCIe slot",
             "powers (70 W T4, 72 W L4) drifted most (-0.11, -0.16; every other type -0.05 or above) and the T4",
             "was the one type over 15% held out (LOMO 15.4%, L4 8.2%): their clocks sag under a sustained load.",
             "Each such card now has a load exponent (cost/sustained.py: a pass of t at full clocks takes",
             "t * max(1, t / 1 ms) ** exponent), fitted with its compute factor; the two cards' fitted exponents",
             "agree (table below), and a slot-powered card nobody measured takes their mean.",
             "The T4's points still disagree with each other at equal work (the tiny layer's forward over 2048",
             "tokens is 1.7x slower as micro-batch 2 of 1024 tokens than as 4 of 512; L4 and A100-40: within 2%),",
             "which no price of the work follows.",
             "",
             "Before (the constants and kernel inventory of commit ffddcb3, the same points): predicted / measured,",
             "median forward / backward / backward at micro-batch 1: A100-40 0.69 / 0.68 / 0.47, A100-80 0.87 / 0.85 /",
             "0.65, RTX A6000 0.77 / 0.73 / 0.43, V100-16 0.98 / 0.89 / 0.69, L4 0.59 / 0.50 / 0.37, T4 0.41 / 0.36 /",
             "0.28, P100 0.40 / 0.42 / 0.36 (A10G, H100 NVL and P40 had no catalog entry).", ""]
    have_before = "before" in data
    head = ("| GPU | n | in-sample \\|error\\| | drift | LOMO \\|error\\| | LOGO \\|error\\| |"
            " LOGO fwd / bwd ratio |")
    rule = "|---|---|---|---|---|---|---|"
    if have_before:
        head += " before: fwd / bwd / bwd mb1 ratio |"
        rule += "---|"
    lines += [head, rule]
    for gpu, row in data["in_sample"].items():
        lomo, logo = data["lomo"][gpu], data["logo"][gpu]
        drift = "-" if row["drift"] is None else f"{row['drift']:+.2f}"
        line = (f"| {gpu} | {row['n']} | {row['median_abs']:.1%} | {drift} | {lomo['median_abs']:.1%} | "
                f"{logo['median_abs']:.1%} | {_r(logo['fwd_ratio'])} / {_r(logo['bwd_ratio'])} |")
        if have_before:
            b = data["before"][gpu]
            line += f" {_r(b['fwd_ratio'])} / {_r(b['bwd_ratio'])} / {_r(b['bwd_mb1_ratio'])} |"
        lines.append(line)
    lines += ["", "Compute factors (what each measured GPU sustains of its family's compute; 1 = the family) and load",
              "exponents (slot-powered cards only; 0 elsewhere):", "",
              "| GPU | factor | load exponent | timings | in-sample median \\|error\\| |", "|---|---|---|---|---|"]
    for gpu, f in data["factors"].items():
        lines.append(f"| {gpu} | {f['compute_scale']:.2f} | {f.get('load_exponent', 0.0):.3f} | {f['n']} | "
                     f"{_r(f['median_abs'])} |")
    lines += ["", "Catalog NVIDIA GPUs priced without any measurement of their own (their family's constants, or the",
              "fallback where the family was not measured either): " + ", ".join(data["unmeasured"]) + ".", ""]
    return lines
