"""Training engines (Horovod Elastic, torch elastic, registered third ones) behind one interface:
`base.py` (the `Engine` interface), `registry.py` (and its table, `names.py`), `dispatch.py` (the
agent runs the job's engine), `installed.py` (whether a node has what an engine needs), `node.py`
(agent side), `drain.py`. What the workers run on, the
worker runner and what a commit is included, is the package below (`elasticyolo/worker_runtime/`). See docs/engines.md."""
