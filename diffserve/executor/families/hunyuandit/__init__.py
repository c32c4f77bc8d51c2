"""HunyuanDiT: a DiT with BERT and T5; request mode only (no step adapter)."""

TITLE = "HunyuanDiT"
