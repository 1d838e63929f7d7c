"""The SGLang plugin (thin layer over the core)."""
