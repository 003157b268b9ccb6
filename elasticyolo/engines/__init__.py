"""Training engines: Horovod Elastic and torch elastic."""
