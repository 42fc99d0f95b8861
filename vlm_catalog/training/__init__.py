"""Training the default model: data mixture, deterministic resumable loop, held-out evaluation.

- `data`: synthetic training examples (mlperf prompt + compact JSON answer) and batches;
- `checkpoint`: training state on disk (weights, optimizer, step, RNG) and the servable model;
- `trainer`: the loop (`TrainConfig`, `Trainer`), deterministic for a seed and resumable;
- `heldout`: accuracy of a model directory through our engine on a held-out catalogue.
"""
