"""Hy3 GRPO reproduction workflow: one module a stage, each with a CLI."""
