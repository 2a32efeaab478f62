"""`pretrain plan --auto`: search the layouts a config can run on a described cluster and rank them
by estimated step time (:mod:`.search` enumerates, :mod:`.estimate` times, :mod:`.auto` reports)."""
