"""Tree speculation, one cycle (`cycle`): draft (`drafter`, the interface; `mtp` and `dspark`, the
drafters; `tree`, the beam they grow, pruning and widths; `values`, `sampled`, `budget`) -> plan (`plan`)
-> verify (`verify`; `policy` picks the rule) -> accept -> commit (`cycle`, over the target's
`model.state`), and the jitted decoding loops over it (`generate`; prompts and options checked by
`inputs`; `stages` jits the stages one by one for measuring); `auto` holds the tuned choice behind
`spec="auto"`."""
