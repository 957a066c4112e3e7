"""Tree speculation: draft (MTP, top-K beam) -> prune -> plan -> verify -> accept -> commit."""
