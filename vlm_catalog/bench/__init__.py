"""Benchmark support: baselines and measurement helpers shared by scripts/bench_*.py."""
