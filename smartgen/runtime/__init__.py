"""The model runtime: prefill with per-layer KV hand-off, decode with sparse attention over local and remote KV."""
