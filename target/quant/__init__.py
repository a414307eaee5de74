"""CPU quantization of a model's linears, for the target and the draft alike.

    modes.py          the mode names a config may ask for (no imports: the config reads them)
    int8.py           `Int8Linear` (W8A8 on fbgemm)
    int4.py           `Int4Linear` (torch's weight-only int4 kernel, optionally an int8 copy)
    qlinear.py        `QLinear` on the group-quantized kernel `qgemm.c` (built per ISA level by `qgemm.py`)
    decoder_stack.py  every decoder layer of a model of `QLinear`s in one C call (`decoder.c`)
    smoothing.py      SmoothQuant before W8A8, on the calibration text `calibration.txt`
    formats.py        the registry: each format's module, converter, fuser and stored tensors
    convert.py        `quantize_model` and `prepare_quantized`, driven by the registry
    cache_file.py     a quantized model saved once and loaded by the registry

Imports go one way: the model (`target.model`) knows nothing of quantization; quantization
converts a model's `nn.Linear`s; the loader (`target.model_weights`) calls it and the runner picks
the layer loop (`decoder_stack`). Nothing is imported here, so reading `modes` stays cheap.
"""
