"""`cosine simulate`: the CoSine cluster as a discrete-event simulation (simpy) that runs this project's own
router, fusion, goodput controller, Gamma_max planning and drafter autoscaling decisions, against step-latency
models of GPUs (or of this machine, fitted from a trace) and acceptance replayed from traces of real runs.

- `replay`: what every drafter would propose at every position of a recorded output; exact greedy verification.
- `hardware`: the latency and price models, with their sources.
- `cluster`: the simulated run: its workload, the verifier loop and its drafting rounds.
- `fleet`: drafter replicas on GPUs behind network hops, and the drafter autoscaler.
- `result`: what a run returns, and its aggregates.
- `studies`: validation against a real run, the paper's settings, and drafter sizing.
"""
