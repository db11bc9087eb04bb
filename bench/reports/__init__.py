"""Reports: the tables and files of a run, and the generated benchmarks page."""
