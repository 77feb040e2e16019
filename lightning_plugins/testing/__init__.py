"""The world harness the tests and the benchmarks share: worlds of CPU processes on gloo (:mod:`.world`), the
exit report of the process-group threads (:mod:`.exit_report`), tiny model configs (:mod:`.models`), the
benchmarks' command line and report (:mod:`.bench`), the small layouts measured for real that the planner's dry run
is checked against (:mod:`.memory_layouts`), what a training step costs a rank in bytes sent, held and allocated
(:mod:`.step_accounting`) and the tensor-parallel benchmark's workload and variants (:mod:`.tp_workload`). Nothing
here is needed to train; it imports no door."""
