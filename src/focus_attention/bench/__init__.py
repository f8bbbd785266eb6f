"""Benchmarks that write JSON results: the sparse attention op against dense attention
(:mod:`.kernel`) and end-to-end prefill of a real model (:mod:`.model`). Every result
records its configuration, library versions and hardware."""
