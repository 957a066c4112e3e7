"""Pure functions over parameter pytrees, one concept per file."""
