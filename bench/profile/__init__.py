"""Profilers: where one piece of the step spends its time or memory (`python -m bench.profile.X`)."""
