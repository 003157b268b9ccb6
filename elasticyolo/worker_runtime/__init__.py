"""What every engine's worker processes run on: the environment an agent hands its workers
(`worker_env.py`), starting them (`spawn.py`) so that they die with the agent (`lifeline.py`),
warm workers forked from a zygote (`prewarm.py`, `zygote.py`), progress to etcd (`progress.py`),
a worker's fatal error on its way to `status` (`worker_errors.py`) and the `elasticyolo worker`
options (`options.py`). Below the engines: the agent, `config.py` and `train/` use it too."""
