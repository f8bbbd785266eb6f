"""Benchmarks that write JSON results: the sparse attention op against dense attention
(:mod:`.kernel`), end-to-end prefill of a real model (:mod:`.model`), needle retrieval
(:mod:`.needle`), zero-shot benchmarks through lm-evaluation-harness (:mod:`.tasks`, with
the lm-eval model and tasks of :mod:`.harness`) and instruction following (:mod:`.instructions`,
over :mod:`focus_attention.evaluation.instructions`). Every result records its configuration,
library versions and hardware. :mod:`.commands` holds each benchmark's command line
(settings, help, the shape of its result; torch-free) and :mod:`.registry` its functions
(run, table, plot), from which ``focus bench NAME`` and a study's report are built. The
ranking of the layers and heads that retrieve (``focus bench retrieval-layers``) is
:mod:`focus_attention.evaluation.retrieval`'s."""
