"""par_zero."""
