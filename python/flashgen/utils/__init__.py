"""flash_attn.utils' module path: `flashgen.utils.generation.InferenceParams` (what MHA's generation path reads)."""
