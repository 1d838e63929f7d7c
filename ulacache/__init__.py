"""ulacache: unified logical KV address space for sparse-attention serving."""
