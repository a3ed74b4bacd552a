"""The pieces of ``benchmarks/bench_frontier.py`` (its docstring says which holds what); imported
with ``benchmarks/`` on ``sys.path``, like the benchmarks' shared ``common``."""
