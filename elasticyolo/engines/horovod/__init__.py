"""Horovod Elastic engine: worker side (`worker.py`) and, on the leader, the driver."""
