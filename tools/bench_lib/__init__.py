"""The parts of the benchmarks in ``tools/`` that are theirs alone (what they all share is
``tools/bench_common.py``).

Modules:
    moe_layer_variants: ``tools/bench_moe_layer.py``'s layer sizes and variants, and the
        layer each variant builds (also profiled by ``tools/host_overhead.py``).
    moe_layer_tables: its tables and markdown report.
    kernel_checks: ``tools/bench_experts.py``'s checks of the kernels against their
        references before it times anything.
"""
