"""The resident engine: sequences, a scheduler over a paged KV pool, one prefill and one batched decode a step."""
