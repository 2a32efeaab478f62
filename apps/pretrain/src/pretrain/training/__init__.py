"""The training run: the loop each rank runs, one step, its micro-batches, the learning rate and dynamic CP."""
