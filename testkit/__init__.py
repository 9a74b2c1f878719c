"""Test support: the processes, clusters, waits and clients that the real-stack tests and the
benchmark harness share.

`serve_process` (`serve run` started and stopped with everything it started),
`loopback_cluster` (a multi-node Ray cluster on loopback), `apps` (an app served on either),
`waits` (`wait_until`: wait for a condition, never for a fixed time), `clients` (requests and
admin calls against a served app), `metrics` (Prometheus counters), `prompts`, and the small
models and simulations several unit-test modules share (`tiny_engine`, `simulated_replica`).
"""
