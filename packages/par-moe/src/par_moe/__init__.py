"""par_moe."""
