"""Version of this package and the Megatron-Core release its patches and hooks target."""

__version__ = "0.1.0"
SUPPORTED_MEGATRON_CORE = "0.19.2"
