"""`llmd launch`, `llmd status`, `llmd cancel`, `llmd sweep`: a spec becomes a Slurm job (launchers/), and a run folder
with a state file (runstate) tells where it stands."""
