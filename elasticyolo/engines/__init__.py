"""Training engines (Horovod Elastic, torch elastic, registered third ones) behind one interface:
`base.py` (the `Engine` protocol), `registry.py`, `dispatch.py` (the agent runs the job's engine),
`node.py` (agent side), `drain.py`, `commit.py`, `worker_env.py`, `spawn.py`, `lifeline.py`,
`progress.py`. See docs/engines.md."""
