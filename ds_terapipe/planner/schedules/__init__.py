"""Built-in schedules, one module each; every module registers its :class:`~..registry.ScheduleSpec`.

``planner.registry`` imports these on first use (its ``_BUILTIN_MODULES``). To add a schedule: write a module
with a builder ``(num_stages, num_microbatches, num_slices) -> Schedule`` and a ``register_schedule`` call, and
list it there (or, outside the package, call ``register_schedule`` from your own code).
"""
