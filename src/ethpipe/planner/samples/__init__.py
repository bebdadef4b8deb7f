"""Level 3, samples -> pipelines: the global batch split by pipeline speed (docs/design.md)."""
