"""The model and its state: parameters and the forward over T new tokens (`network`), the
position-addressed decode state and its commit (`state`), token sampling (`sampling`), chunked
prefill and its memory plan (`prefill`, `prefill_plan`), and the sharded programs above them
(`placement`, `runner`)."""
