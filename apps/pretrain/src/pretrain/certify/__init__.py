"""`pretrain certify`: the user's own layout, narrowed, trains the same model as one rank -- or the
first module that does not.

One concept per file:

- :mod:`.narrow`: the narrowed copy of the user's config (every kind of layer, the layout exactly)
  and the one-rank reference's config;
- :mod:`.fp64`: the reference's own fp32-vs-fp64 distance (the measured rounding noise);
- :mod:`.record`: what a step leaves to compare: every module's output per micro-batch, and every
  parameter's reduced gradient gathered to its full tensor from its declared placement;
- :mod:`.localise`: a layout's shard of a module output against the reference's full tensor, the
  parallel dimension that owns it, and the first tensor out of its band;
- :mod:`.verdict`: per-step bands, the one-line verdict and the JSON report;
- :mod:`.ranks`: what the reference rank and the layout's ranks run.
"""
