"""Planning at run time: which slicing every rank runs, decided from measurements.

``plan`` (resolve the slices for a sequence length: from the config, the cache or a profile; solved on rank 0
and agreed by all), ``plan_cache`` (plans and profiles on disk, keyed by what determines them), ``profile`` and
``step_profile`` (timing each chunk's slices and the step's fixed terms), ``replan`` (refit to measured steps and
switch plans when it pays), ``slice_check`` (the init-time check that a model's layers are causal and slice
exactly).
"""
