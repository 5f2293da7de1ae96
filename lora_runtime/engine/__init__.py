"""The serving side: requests, forward batches, KV cache, scheduler, model runner, engine."""
