"""What pipeline benchmarks share, so a new one (schedules, virtual stages, freezing) is mostly its own variants.

* :mod:`.launch`: start the benchmark script as its own workers on N local ranks, echo rank 0's progress,
  collect each rank's JSON; pin a worker to its core with one thread.
* :mod:`.meters`: time every pipeline instruction of an engine, per-step summaries and timeline events;
  activation memory (saved tensors + KV buffers), peak heap of a step, foreign CPU load.
* :mod:`.alternate`: alternated rounds with a clean-round filter; medians, paired ratios.
* :mod:`.tables`: markdown tables, target checks, and the JSON report with commit and machine, written to
  ``benchmarks/results/<name>.json`` by default.

Scripts in ``benchmarks/`` import it as ``benchlib`` (their own directory is on ``sys.path``); tests as
``benchmarks.benchlib``. Its modules import torch only where a meter needs it (a worker pins its cores first).
"""
