"""The train loop, its step, schedules, validation, preemption, ensembles and warm starts."""
