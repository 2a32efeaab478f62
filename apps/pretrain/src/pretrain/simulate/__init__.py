"""``pretrain plan --simulate``: one rank of a large world run on fake tensors, measured against the plan."""
