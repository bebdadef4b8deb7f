"""What a run reports: per-step statistics and records (`metrics`), TensorBoard / W&B sinks (`sinks`) and per-action timings and traces (`timeline`)."""
