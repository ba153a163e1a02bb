"""Llama-family decoders on kiln ops, their config, the safetensors loader and demo models."""
