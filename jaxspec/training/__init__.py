"""Training: datasets and the tokenizer (`data`, `tokenizer`), packed rows (`packing`), the
optimizer and step clock (`optim`), joint target + MTP training (`train`) and draft training
(`distill`: the distilled draft, and DeepSeek's one-step recipe)."""
