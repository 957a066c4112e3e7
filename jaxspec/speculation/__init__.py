"""Tree speculation: draft (MTP, top-K beam; `draft`) -> prune (`values`, `budget`, `widths`) ->
plan (`plan`) -> verify (`verify`, `rules`, `sampled`) -> accept -> commit (`commit`), and the
jitted decoding loops over them (`generate`); `auto` holds the tuned choice behind `spec="auto"`."""
