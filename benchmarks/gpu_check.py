"""GPU check, prepared for a short lease: measure, compare with the calibrated model, run tests/gpu.

On the GPU it finds (matched to a catalog id by its name), it profiles one decoder block, the
embedding and the head of a few model widths in fp32 (TF32 off), fp32 (TF32 on) and bf16 with SDPA's
fused attention, and in fp32 with its math (materialised) path, with ``ethpipe.profiler`` (the
runtime's own modules), prices the same layers with the calibrated cost model for that GPU type
(``attention`` auto or materialised to match), runs ``pytest tests/gpu``, and writes docs/benchmarks/gpu.{md,json}. It also keeps the measured profiles
(``gpu_profiles/*.json``, this run's only) and fits the GPU family's constants to their block and head
passes (``gpu_calibration.yaml``: `ethpipe calibrate`'s fit, centred on the shipped fallback, on the
passes the shipped fit uses): the shipped constants come from fp32 profiles only, so this fit is what
measures the family's 16-bit tensor-core efficiency.
It also measures one-stage training throughput of ethpipe's runtime against a plain PyTorch loop of the
same model and kernels, with and without ``--compile`` (``gpu_throughput.py``).
Meant to finish in under 8 minutes on one GPU; ``--device cpu`` runs the same logic on the CPU
with tiny widths (what the tests do here).

    python benchmarks/gpu_check.py                       # on the GPU machine
    python benchmarks/gpu_check.py --device cpu --widths 64 --seq-len 32 --skip-tests
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_throughput import measure_throughput, render_throughput  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "docs" / "benchmarks"
# (dtype, tf32, attention): SDPA's fused kernels in each precision, and Megatron's unfused fp32 path (the
# calibration profiles' runtime) through SDPA's math backend.
MODES = (("fp32", False, "auto"), ("fp32", True, "auto"), ("bf16", True, "auto"), ("fp32", True, "materialised"))


@dataclass(frozen=True)
class Row:
    """One layer pass measured and predicted."""

    width: int
    dtype: str
    tf32: bool
    attention: str
    kind: str
    micro_batch: int
    measured_ms: tuple[float, float]  # fwd, bwd
    predicted_ms: tuple[float, float]

    @property
    def errors(self) -> tuple[float, float]:
        return tuple(p / m - 1 for p, m in zip(self.predicted_ms, self.measured_ms))  # type: ignore[return-value]


def match_gpu(device_name: str) -> str | None:
    """The catalog id of a CUDA device name ("NVIDIA H200" -> "h200_sxm"), None if nothing matches
    (``ethpipe.runtime.start.placement.identify_gpu``, the runtime's placement check's matching)."""
    from ethpipe.runtime.start.placement import identify_gpu

    return identify_gpu(device_name)


def _spec(width: int, seq_len: int):  # type: ignore[no-untyped-def]
    from ethpipe.model_spec import ModelSpec

    heads = max(1, width // 64)  # Llama-style: head dim 64, GQA 4:1 where it divides, SwiGLU 8/3 h
    kv_heads = heads // 4 if heads % 4 == 0 else heads
    ffn = (8 * width // 3 + 63) // 64 * 64
    return ModelSpec(name=f"check-{width}", num_layers=2, hidden_size=width, num_heads=heads, num_kv_heads=kv_heads,
                     ffn_hidden_size=ffn, vocab_size=32000, max_seq_len=seq_len)


def measure(device: str, gpu_id: str, widths: list[int], seq_len: int, micro_batches: tuple[int, ...],
            repeats: int, profile_dir: Path | None = None) -> list[Row]:
    """Every mode's layer passes measured and priced; each mode's profile saved to ``profile_dir`` if given."""
    from ethpipe.cluster import cluster_from_dict
    from ethpipe.cost.model import CostModel, dtype_bytes
    from ethpipe.profiler import ProfileSettings, profile_model

    rows = []
    node = {"gpu": gpu_id, "num_nodes": 1, "gpus_per_node": 1, "nic_gbit_s": 100}
    cluster = cluster_from_dict({"nodes": [node]})
    for width in widths:
        spec = _spec(width, seq_len)
        for dtype, tf32, attention in MODES:
            prof = profile_model(spec, ProfileSettings(seq_len=seq_len, micro_batch_sizes=micro_batches,
                                                       device=device, dtype=dtype, repeats=repeats, warmup=2,
                                                       tf32=tf32, attention=attention))
            if profile_dir is not None:
                prof.save(profile_dir / f"w{width}_{dtype}_tf32{'on' if tf32 else 'off'}_{attention}.json")
            cost = CostModel(cluster, spec, seq_len, dtype_bytes=dtype_bytes(dtype), dtype=dtype, tf32=tf32,
                             attention_mode=attention)
            for b in micro_batches:
                predicted = {"block": cost.layer_times_s(gpu_id, b),
                             "embedding": cost.end_times_s(gpu_id, b, 1, first=True, last=False),
                             "head": cost.end_times_s(gpu_id, b, 1, first=False, last=True)}
                for kind, (fwd_s, bwd_s) in predicted.items():
                    t = prof.layers[kind][b]
                    rows.append(Row(width, dtype, tf32, attention, kind, b, (t.fwd_s * 1e3, t.bwd_s * 1e3),
                                    (fwd_s * 1e3, bwd_s * 1e3)))
    return rows


def fit_family(gpu_id: str, profile_dir: Path, source: str, out: Path) -> dict[str, Any]:
    """Fit the GPU family's constants to the saved profiles (`ethpipe calibrate`'s fit) and write them to ``out``."""
    import yaml

    from ethpipe.catalog import get_gpu
    from ethpipe.cost import calibrate
    from ethpipe.cost.hardware import DEFAULT_CONSTANTS, shipped_calibration
    from ethpipe.cost.profile import load_profile

    gpu = get_gpu(gpu_id)
    obs = [o for path in sorted(profile_dir.glob("*.json")) for o in calibrate.observations(load_profile(path), gpu)
           if o.kind != "embedding"]  # as the shipped fit: blocks and heads
    fitted = calibrate.fit(obs, source=source, prior=shipped_calibration().fallback or DEFAULT_CONSTANTS)
    out.write_text(yaml.safe_dump(fitted.to_dict(), sort_keys=False))
    errors = sorted(abs(e) for e in calibrate.relative_errors(obs, fitted))
    return {"arch": gpu.arch, "constants": shipped_calibration().merged(fitted).constants(gpu.arch)[0].to_dict(),
            "informed": list(fitted.architectures[gpu.arch].fitted),
            "shipped": shipped_calibration().constants(gpu.arch)[0].to_dict(), "num_passes": len(obs),
            "median_error": errors[len(errors) // 2], "worst_error": errors[-1]}


def run_gpu_tests() -> dict[str, Any]:
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/gpu"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    summary = next((line for line in reversed(proc.stdout.splitlines()) if "passed" in line or "failed" in line
                    or "skipped" in line), proc.stdout[-200:])
    return {"returncode": proc.returncode, "summary": summary.strip("= "), "wall_s": time.time() - start,
            "tail": proc.stdout[-3000:]}


def render(result: dict[str, Any]) -> str:
    lines = ["# GPU check (generated)", "",
             f"Measured on {result['device_name']} (catalog id `{result['gpu_id']}`), {result['machine']}, "
             f"{result['wall_s']:.0f} s in all. Reproduce: `python benchmarks/gpu_check.py`. Times are one layer "
             "pass of ethpipe's own modules (`ethpipe.profiler`, median of the repeats) vs the calibrated cost "
             "model for that GPU type (`ethpipe.cost`), ms; error = predicted / measured - 1.", "",
             "| width | dtype | TF32 | attention | layer | micro-batch | measured fwd / bwd | predicted fwd / bwd | error |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        mf, mb = r["measured_ms"]
        pf, pb = r["predicted_ms"]
        ef, eb = (p / m - 1 for p, m in zip(r["predicted_ms"], r["measured_ms"]))
        lines.append(f"| {r['width']} | {r['dtype']} | {'on' if r['tf32'] else 'off'} | {r['attention']} | {r['kind']} | "
                     f"{r['micro_batch']} | {mf:.3f} / {mb:.3f} | {pf:.3f} / {pb:.3f} | {ef:+.0%} / {eb:+.0%} |")
    block = [abs(e) for r in result["rows"] if r["kind"] == "block"
             for e in (p / m - 1 for p, m in zip(r["predicted_ms"], r["measured_ms"]))]
    if block:
        block.sort()
        lines += ["", f"Block passes: median |error| {block[len(block) // 2]:.0%}, worst {block[-1]:.0%} "
                      f"over {len(block)} passes."]
    fit = result.get("fit")
    if fit:
        from ethpipe.cost.hardware import CONSTANT_NAMES as names
        lines += ["", f"## Constants fitted to these profiles ({fit['arch']}, {fit['num_passes']} block and head passes)",
                  "", f"Written to gpu_calibration.yaml (use: `ethpipe plan --catalog gpu_calibration.yaml`); in-sample "
                      f"median |error| {fit['median_error']:.0%}, worst {fit['worst_error']:.0%}.", "",
                  "| constant | shipped | with these profiles | informed by these profiles |", "|---|---|---|---|"]
        lines += [f"| {n} | {fit['shipped'][n]:.4g} | {fit['constants'][n]:.4g} | "
                  f"{'yes' if n in fit['informed'] else 'no'} |" for n in names]
    elif result.get("fit_error"):
        lines += ["", "## Constants fitted to these profiles", "", f"The fit failed: {result['fit_error']}"]
    if result.get("throughput"):
        lines += render_throughput(result["throughput"])
    tests = result.get("tests")
    lines += ["", "## tests/gpu", "", f"`{tests['summary']}` (exit {tests['returncode']}, {tests['wall_s']:.0f} s)"
              if tests else "not run (`--skip-tests`)", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--gpu-id", help="catalog id to price against (default: matched from the device name)")
    parser.add_argument("--widths", default="1024,2048,4096")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batches", default="1,4")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--throughput-width", type=int, default=2048, help="model width of the throughput check")
    parser.add_argument("--throughput-layers", type=int, default=8)
    parser.add_argument("--throughput-compile", choices=("auto", "yes", "no"), default="auto",
                        help="also measure with --compile (auto: on CUDA)")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--out-dir", type=Path, default=OUT)
    args = parser.parse_args(argv)
    started = time.time()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on the GPU machine, or --device cpu for a dry run")
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor() or "cpu"
    gpu_id = args.gpu_id or match_gpu(name) or "a100_80gb_sxm"
    profile_dir = args.out_dir / "gpu_profiles"
    shutil.rmtree(profile_dir, ignore_errors=True)  # an earlier run's profiles (other widths, another GPU) go
    profile_dir.mkdir(parents=True)
    rows = measure(args.device, gpu_id, [int(w) for w in args.widths.split(",")], args.seq_len,
                   tuple(int(b) for b in args.micro_batches.split(",")), args.repeats, profile_dir)
    result: dict[str, Any] = {
        "device_name": name, "gpu_id": gpu_id, "gpu_id_matched": args.gpu_id is None and match_gpu(name) is not None,
        "machine": f"torch {torch.__version__}, CUDA {torch.version.cuda}", "rows": [r.__dict__ for r in rows],
    }
    (args.out_dir / "gpu.json").write_text(json.dumps(result, indent=1) + "\n")  # the measurements, before anything fails
    try:
        result["fit"] = fit_family(gpu_id, profile_dir, f"benchmarks/gpu_check.py on {name}",
                                   args.out_dir / "gpu_calibration.yaml")
    except Exception as err:  # noqa: BLE001  (a scarce GPU run keeps its rows and the tests whatever the fit does)
        result["fit_error"] = f"{type(err).__name__}: {err}"
    if not args.skip_throughput:
        compiled = args.throughput_compile == "yes" or (args.throughput_compile == "auto" and args.device == "cuda")
        result["throughput"] = measure_throughput(args.device, args.throughput_width, args.throughput_layers,
                                                  args.seq_len, compile_modes=(False, True) if compiled else (False,))
        (args.out_dir / "gpu.json").write_text(json.dumps(result, indent=1) + "\n")
    result["tests"] = None if args.skip_tests else run_gpu_tests()
    result["wall_s"] = time.time() - started
    (args.out_dir / "gpu.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out_dir / "gpu.md").write_text(render(result))
    print(render(result))
    return result


if __name__ == "__main__":
    main()
