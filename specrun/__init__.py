"""specrun: fast local LLM decoding with speculative draft trees on llama.cpp."""

__version__ = "0.1.0"
