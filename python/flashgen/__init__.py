"""flashgen: exact attention in three generations."""
