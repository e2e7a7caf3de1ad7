"""Commands beside `train` and `eval`, each reached through the CLI: `plan` (memory, layouts, cost), `report`
(charts of a run), `doctor` (what this machine can do), `export` (a checkpoint as a model folder), `supervise`
(the restart loop for preemptible runs)."""
