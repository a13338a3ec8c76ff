"""SmartGen: a KV-cache transfer engine for disaggregated LLM inference."""

__version__ = "0.1.0"
