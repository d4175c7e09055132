"""Evaluation: how bounded replay diverges from the exact model, and where capability drops."""
