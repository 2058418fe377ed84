"""Robustness runs: the server under attack, long fuzzing, soak, leaks, and the cgroups a
benchmark process is held in."""
