"""specchat: chat with a local LLM, faster, through lossless speculative decoding."""

__version__ = "0.1.0"
