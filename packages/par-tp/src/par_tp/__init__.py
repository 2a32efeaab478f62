"""par_tp."""
