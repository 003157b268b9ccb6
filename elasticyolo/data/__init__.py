"""Datasets: synthetic generation and `data.yaml` validation (no torch)."""
