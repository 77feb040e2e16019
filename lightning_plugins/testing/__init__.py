"""The world harness the tests and the benchmarks share: worlds of CPU processes on gloo (:mod:`.world`), the
exit report of the process-group threads (:mod:`.exit_report`), tiny model configs (:mod:`.models`) and the
benchmarks' command line and report (:mod:`.bench`). Nothing here is needed to train; it imports no door."""
