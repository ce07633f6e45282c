"""What turns a deployment spec into Slurm jobs: the het-job plan (pure), its batch script, submitit's executor
extended to het jobs, and what runs inside the job (main_job on component 0, engine_task on engine nodes)."""
