"""Benchmark scripts; their recorded results live in bench/results/*.json."""
