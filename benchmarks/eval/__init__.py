"""Helpers of ``benchmarks/evaluate.py``: scenarios, one module per section, figures and the markdown template."""
