"""Planning for token-level pipelines: cost models, optimal slicing, schedule IR, simulation.

Everything under ``ds_terapipe.planner`` is plain Python + numpy: it imports neither torch.distributed
nor deepspeed, so a planning CLI or a unit test starts in milliseconds.
"""
