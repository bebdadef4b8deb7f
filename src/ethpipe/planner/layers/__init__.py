"""Level 2, layers -> stages: a pipeline's layer split and its closed-form time (docs/design.md)."""
