"""A running job's guards and records: the run lock, preemption, faults, the non-finite guard, perf, the manifest, logger records."""
