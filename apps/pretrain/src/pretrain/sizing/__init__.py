"""One model of the bytes and FLOPs of a layout, read by `plan`, `plan --auto` and `plan --simulate`.

- :mod:`.flops`: the whole model's parameter counts and training FLOPs (and MFU's numerator);
- :mod:`.params`: the parameter elements one rank holds (its stage, tp / ep / expert tp shards);
- :mod:`.state`: their model-state bytes in par-zero's convention, per ZeRO strategy;
- :mod:`.activations`: the activation bytes one micro-batch of a chunk keeps;
- :mod:`.schedule_peak`: a stage's peak, walking its pipeline schedule as the executor runs it;
- :mod:`.memory`: one rank's total, the heaviest stage, and the GPU memory budget.
- :mod:`.replicas`: what `[model].expert_balance = "replicate"` fetches, returns and holds per MoE layer.

`plan --simulate` measures the trainer itself on fake tensors and prints these figures beside
what it measured; the tests hold them together (params, grads and optimizer state within 1 %,
activations within 10 % on the shapes tested).
"""
