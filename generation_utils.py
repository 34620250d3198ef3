"""DSpark speculative decoding for transformers targets (work in progress: filled by the generation issue)."""
