"""pdserve: disaggregated prefill/decode serving for hybrid KDA + MLA models."""
__version__ = "0.1.0"
