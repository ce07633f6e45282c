"""The cluster simulator: a deployment on one core in virtual time, running llmd's own router core and engine core.

loop.py (the clock), tokens.py and context.py (agents' prompts as token runs and block hashes), engines.py (every
engine rank an EngineCore stepped by the latency model; KV events and transfers), router.py (RouterCore driven by
events), agents.py (the workload generator's sessions as closed-loop agents), record.py (the one metrics schema),
run.py (one run), params.py (the simulator's own delays), cli.py (`llmd simulate`).
"""
