"""flash_attn.modules' module path: `flashgen.modules.mha` (flash_attn.modules.mha's attention modules)."""
