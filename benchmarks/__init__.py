"""Benchmark scripts (run them by path: ``python benchmarks/pipeline_speedup.py``) and their library, ``benchlib``.

A package only so that tests can import the library as ``benchmarks.benchlib`` (tests/test_bench_meters.py);
nothing here is installed with ds_terapipe.
"""
