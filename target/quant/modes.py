"""The quantization modes a config may name (see `formats.MODES` for what each does)."""

QUANT_MODES = ("none", "int4", "auto", "w8a8", "int4+w8a8", "w4a8", "w4a8-auto", "gguf")
