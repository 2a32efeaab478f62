"""par_cp."""
