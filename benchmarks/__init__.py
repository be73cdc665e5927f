"""Benchmarks behind `cosine bench ...`: side-by-side runs that print tables and write JSON."""
