"""par_pp."""
