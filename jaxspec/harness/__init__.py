"""The research harness above the decoding loops: the tree-vs-linear sweep (`eval`) and its tables
and figures (`report`), the chooser of `spec="auto"` (`tune`), node-value fitting (`calibrate`,
`calibrate_residual`) and one cycle as separately jitted stages (`stages`)."""
