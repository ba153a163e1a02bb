"""Serving-side machinery: paged KV cache, scheduler, runner, sampler, tokenizer, engine."""
