"""flashgen inside other libraries' models. Each submodule imports its library lazily and registers on import:

    import flashgen.integrations.transformers      # adds attn_implementation="flashgen" to Hugging Face transformers

The submodules are optional: importing this package imports none of them.
"""
