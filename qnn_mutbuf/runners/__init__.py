"""Runners: execute a `.pte` step by step on the host simulator, a phone or AI Hub."""
