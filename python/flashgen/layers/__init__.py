"""flash_attn.layers' module path: `flashgen.layers.rotary` (flash_attn.layers.rotary's functions)."""
