"""etcd layer: the client wrapper, the key layout, the node registry and leader election."""
