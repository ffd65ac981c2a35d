"""Benchmarks (not tests): each script prints its figures with the goal beside them."""
