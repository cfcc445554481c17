"""Measurement as a library: the experiments `bench` and `tune` run on a loaded pair, and the prompts they decode."""
