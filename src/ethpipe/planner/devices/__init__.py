"""Level 1, devices -> pipelines: which devices form each pipeline kind and how many of each (docs/design.md)."""
