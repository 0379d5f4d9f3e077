"""Benchmarks: ``python -m nbgen.bench`` (throughput vs the bandwidth floor), ``nbgen.bench.grammar``
(structured output), ``nbgen.bench.sim`` (schedule cost model), ``nbgen.bench.soak`` (long-run soak)."""
