"""The recipe path: the schema, building the run, resume diffs, preflight, plots, tiny twins."""
