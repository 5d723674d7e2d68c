"""Functional API: fused embedding lookups over tables and variables (issue 6)."""
