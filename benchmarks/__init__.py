"""Developer benchmarks, kernel tuners and one-off probes: run from the repository root, e.g.
`python -m benchmarks.offline CONFIG_DIR --workloads W1`. Not part of the wheel; deltaserve never imports them."""
