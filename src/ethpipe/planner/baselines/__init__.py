"""The baselines priced in the same cost model: uniform (Megatron-style) and layer-balanced (Metis/AMP-style)."""
