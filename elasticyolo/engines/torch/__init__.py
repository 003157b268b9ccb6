"""torch elastic engine: an etcd v3 rendezvous (`rendezvous`) registered for torchrun as
`--rdzv-backend=etcd3` (`rdzv_plugin`). Import submodules directly; this package imports no torch."""
