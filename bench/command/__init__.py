"""The command line: flags and presets, the CLI, the run that compiles and times each case, multi-process set-up."""
