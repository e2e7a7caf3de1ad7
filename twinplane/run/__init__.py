"""A run, from the command line's config to its run dir: check the input and build what it needs (`prepare`,
`preflight`), the loop of RL steps through the controller (`loop`), checkpoints and resume (`checkpoint`,
`run_state`, `run_dir`), stop requests (`signals`), evaluation, metrics and loggers."""
