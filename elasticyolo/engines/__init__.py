"""Training engines (Horovod Elastic, torch elastic, registered third ones) behind one interface:
`base.py` (the `Engine` protocol), `registry.py`, `dispatch.py` (the agent runs the job's engine),
`node.py` (agent side), `drain.py`, `commit.py`. What the workers run on is the package below
(`elasticyolo/worker_runtime/`). See docs/engines.md."""
