"""Benchmarks and failure injection (``p2p-bench``). Nothing else in the project imports this."""
