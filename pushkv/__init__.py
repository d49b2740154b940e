"""pushkv: push-based KV-cache transfer for prefill/decode-disaggregated inference."""

__version__ = "0.1.0"
