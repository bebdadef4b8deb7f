"""`ethpipe plan`, `ethpipe compare`, `ethpipe catalog` (owned by the planner work)."""

from __future__ import annotations

from ethpipe.cli.app import app, console


@app.command()
def catalog() -> None:
    """List the built-in GPUs and model presets."""
    from ethpipe.catalog import gpu_catalog
    from ethpipe.model_spec import model_presets

    for g in gpu_catalog().values():
        console.print(f"{g.id:18s} {g.memory_gib:6.0f} GiB {g.peak_tflops:8.1f} TFLOP/s")
    for m in model_presets().values():
        console.print(f"{m.name:18s} {m.num_params() / 1e9:8.3f} B params, {m.num_layers} layers")
