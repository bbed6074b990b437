"""Everything that runs inside DeepSpeed: slice context, sliced attention, module, schedule, engine, profiling."""
