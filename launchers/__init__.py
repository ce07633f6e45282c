"""The control plane: a deployment spec becomes Slurm jobs. `llmd launch/status/cancel` (cli), the run folder and its
state (prepare, runstate, follow), the het-job plan (pure) and its batch script, submitit's executor extended to het
jobs, and what runs inside the job (main_job on component 0, engine_task on engine nodes). Uses llmd; llmd never
imports it, except its command line (llmd.cli) registering these commands."""
