"""Everything that knows Megatron-Core (the only package here that imports megatron)."""
