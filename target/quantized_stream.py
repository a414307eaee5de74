"""Quantize a model straight from its checkpoint file, one decoder layer at a time.

The model is built on the meta device; each layer's tensors are read (float32, one at a time, from
the mapped GGUF or safetensors: `checkpoint_reader`), converted to the format the layer runs in
(`quant.convert.quantize_linears`), and their float copies dropped before the next layer is read.
Nothing dense is written to disk and the memory peak is the packed model plus one float32 layer
(plus the float32 embedding until its rows are looked up, and the float32 LM head at the end).

A mode that smooths (`"w8a8"`, SmoothQuant) needs the activations of a float forward over the
calibration text. That forward drives the loading: a hook before layer i reads it, a hook after it
(its linears have then seen their inputs) smooths and converts it, so layer i is calibrated on
exactly the activations the former whole-model float32 forward gave it and the weights come out
bitwise the same. The LM head's input is recorded, its [T, V] output never computed.

    >>> model = stream_quantized(folder, config, "w8a8", torch.bfloat16, calibration_ids)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import re
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from specdec.target.checkpoint_reader import CheckpointReader, layer_index, open_checkpoint, param_sources
from specdec.target.config import ModelConfig
from specdec.target.gguf_embedding import GGUFEmbedding
from specdec.target.model import LlamaForCausalLM
from specdec.target.quant.convert import quantize_linears, untie_lm_head
from specdec.target.quant import kquant
from specdec.target.quant.formats import MODES, linear_kind
from specdec.target.quant.qgemm import require_qgemm
from specdec.target.quant.qlinear import QLinear
from specdec.target.quant.smoothing import recording_absmax, smooth_head, smooth_layer
from specdec.target.runner import ModelRunner, Window, weight_bytes


def stream_quantized(
    model_dir: Path, config: ModelConfig, mode: str, dtype: torch.dtype,
    calibration_ids: Callable[[], list[int]], progress: bool = True,
    stats: dict[str, torch.Tensor] | None = None, keep_stats: dict[str, torch.Tensor] | None = None,
    part=None,
) -> tuple[LlamaForCausalLM, dict[str, float]]:
    """The model of `model_dir` with its linears in `mode`'s format and the rest in `dtype`, and
    the seconds spent per phase (`read`: read and dequantize, `quantize`, `calibrate`: the float
    forward of a smoothing mode, without the reading and converting done inside it).

    A smoothing mode takes the input maxima `stats` when given (shipped ones: `shipped_stats`)
    instead of calibrating; `keep_stats` receives those a calibration measured.

    `part` (`model_weights.LoadPart`, a mode without smoothing): layers outside `part.layers`
    are left unread (on the meta device), and `part.cut` applied to each layer once converted."""
    if mode not in MODES:
        raise ValueError(f"quantization must be one of {sorted(MODES)}, got {mode!r}")
    quant = MODES[mode]
    if quant.needs_kernel:
        require_qgemm()  # fail before reading, with the reason
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.rotary = type(model.rotary)(config.hf_config, config.head_dim, model.max_positions)
    model.eval()
    untie_lm_head(model)  # on meta: the head is read from the file like any other tensor
    if part is not None and quant.smooth:
        raise ValueError("a part of a model is loaded only in a mode without smoothing")
    with open_checkpoint(model_dir) as reader:
        layers = _LayerLoader(model, reader, mode, dtype, part)
        what = "reading the GGUF's blocks as stored" if quant.file_blocks else f"quantizing to {mode} (once; cached)"
        bar = tqdm(total=config.num_layers + 1, desc=what, unit="layer",
                   leave=False, disable=not progress)
        with bar:
            if quant.smooth and stats is not None:
                layers.smooth_and_convert(stats, bar)
            elif quant.smooth:
                measured = layers.calibrate_and_convert(calibration_ids(), bar)
                if keep_stats is not None:
                    keep_stats.update(measured)
            else:
                layers.convert_in_order(bar)
    if quant.file_blocks:
        model.load_notices = layers.not_as_stored()  # kept in a cache file, and said again on its loads
        for line in model.load_notices:
            print(f"specdec: {line}", file=sys.stderr, flush=True)
    return model, layers.seconds


class _LayerLoader:
    """Reads, converts and casts the parts of one model (`fill`, `convert`), timing each phase."""

    def __init__(self, model: LlamaForCausalLM, reader: CheckpointReader, mode: str, dtype: torch.dtype,
                 part=None) -> None:
        self.model, self.reader, self.mode, self.dtype, self.part = model, reader, mode, dtype, part
        self.sources = param_sources(reader, [n for n, _ in model.named_parameters()], model.config)
        self.seconds = {"read": 0.0, "quantize": 0.0, "calibrate": 0.0}
        # mode "gguf": the linears whose blocks no kernel reads as stored, by (GGUF type, why):
        # [linear name, bytes in the file, bytes as converted (0 until converted)]
        self.not_taken: dict[tuple[str, str], list[list]] = defaultdict(list)

    def fill(self, prefix: str) -> None:
        """Read the parameters under module `prefix` (float32); an embedding whose GGUF rows can
        be used as stored stays in the file (`GGUFEmbedding`)."""
        start = time.perf_counter()
        if prefix == "model.embed_tokens":
            gguf_name = self.reader.rows_in_place(self.sources["model.embed_tokens.weight"])
            if gguf_name is not None and type(self.model.model.embed_tokens) is nn.Embedding:
                self.model.model.embed_tokens = GGUFEmbedding(self.reader.file, gguf_name, torch.float32)
                return
        if MODES[self.mode].file_blocks:
            self._take_file_blocks(prefix)
        with _plain_tensors():
            for name, param in list(self.model.named_parameters()):
                if param.is_meta and (name == prefix or name.startswith(prefix + ".")):
                    tensor = self.reader.read(self.sources[name]).to(torch.float32)
                    module, _, attr = name.rpartition(".")
                    setattr(self.model.get_submodule(module), attr, nn.Parameter(tensor, requires_grad=False))
        self.reader.release_pages()  # read once: the float32 copies are what the next step uses
        self.seconds["read"] += time.perf_counter() - start

    def _take_file_blocks(self, prefix: str) -> None:
        """The linears under `prefix` whose GGUF blocks the kernel reads as stored (the types of
        `kquant.KIND_NAMES`, on whole tiles) become `QLinear`s of those tiles straight from the
        file: no float copy is made. The others are noted in `not_taken`."""
        for name, module in list(self.model.named_modules()):
            if type(module) is not nn.Linear or getattr(module, "keep_dense", False) or not module.weight.is_meta:
                continue
            if not (name == prefix or name.startswith(prefix + ".")):
                continue
            found = self.reader.blocks(self.sources[f"{name}.weight"])
            kind = None if found is None else kquant.GGML_KINDS.get(found[1])
            if kind is None or not kquant.fits(kind, module.out_features, module.in_features):
                if found is not None:
                    why = "no kernel yet" if kind is None else "off the tile grid"
                    self.not_taken[(kquant.ggml_type_name(found[1]), why)].append([name, found[0].nbytes, 0])
                continue
            bias = None if module.bias is None else self.reader.read(self.sources[f"{name}.bias"]).float()
            parent, _, attr = name.rpartition(".")
            setattr(self.model.get_submodule(parent) if parent else self.model, attr,
                    QLinear.from_gguf(found[0], kind, module.in_features, bias))

    def convert(self, prefix: str) -> None:
        """Quantize the linears under `prefix`, cast its other parameters to the model dtype."""
        start = time.perf_counter()
        module = self.model.get_submodule(prefix)
        if isinstance(module, GGUFEmbedding):
            module.dtype = self.dtype
        with _plain_tensors():
            quantize_linears(self.model, self.mode, prefix)
            cast_dense(module, self.dtype)
        for entries in self.not_taken.values():
            for entry in entries:
                if entry[0] == prefix or entry[0].startswith(prefix + "."):
                    entry[2] = weight_bytes(self.model.get_submodule(entry[0]))
        self.seconds["quantize"] += time.perf_counter() - start

    def not_as_stored(self) -> list[str]:
        """One line per GGUF type whose linears were converted instead of read as stored: the
        type, why, which tensors, and the bytes they take in the file and as converted."""
        lines = []
        for (type_name, why), entries in sorted(self.not_taken.items()):
            names = sorted({re.sub(r"^model\.layers\.\d+\.", "", e[0]) for e in entries})
            layers = {m.group(1) for e in entries if (m := re.match(r"^model\.layers\.(\d+)\.", e[0]))}
            where = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
            if layers:
                where += f" in {len(layers)} layer{'s' if len(layers) > 1 else ''}"
            file_mb, now_mb = sum(e[1] for e in entries) / 1e6, sum(e[2] for e in entries) / 1e6
            lines.append(f"{len(entries)} {type_name} tensor{'s' if len(entries) > 1 else ''} ({where}): {why}, "
                         f"re-quantized as w4a8-auto does (int4 / int8 tiles): {now_mb:.1f} MB where the file "
                         f"holds {file_mb:.1f} MB")
        return lines

    def convert_in_order(self, bar: tqdm) -> None:
        """Without calibration: every part in turn."""
        self.fill("model.embed_tokens")
        self.convert("model.embed_tokens")
        for i, layer in enumerate(self.model.model.layers):
            if self.part is None or self.part.keeps(i):
                self.fill(f"model.layers.{i}")
                self.convert(f"model.layers.{i}")
                if self.part is not None and self.part.cut is not None:
                    self.part.cut(i, layer)
            bar.update()
        self._convert_head()
        bar.update()

    def smooth_and_convert(self, stats: dict[str, torch.Tensor], bar: tqdm) -> None:
        """SmoothQuant from known input maxima: every part in turn, smoothed before converting."""
        self.fill("model.embed_tokens")
        self.convert("model.embed_tokens")
        for i in range(len(self.model.model.layers)):
            self.fill(f"model.layers.{i}")
            with _plain_tensors():
                smooth_layer(self.model, i, stats)
            self.convert(f"model.layers.{i}")
            bar.update()
        self.fill("model.norm")
        self.fill("lm_head")
        with _plain_tensors():
            smooth_head(self.model, stats)
        self._convert_head()
        bar.update()

    def calibrate_and_convert(self, token_ids: list[int], bar: tqdm) -> dict[str, torch.Tensor]:
        """SmoothQuant: one float forward over `token_ids` reads and converts the layers in turn;
        returns the input maxima it measured."""
        model = self.model
        self.fill("model.embed_tokens")
        self.fill("model.norm")
        head, model.lm_head = model.lm_head, _RecordedHead(model.lm_head.in_features)
        hooks = []
        start, inside = time.perf_counter(), self.seconds["read"] + self.seconds["quantize"]
        with recording_absmax(model) as stats:

            def finish_layer(i: int) -> None:
                with _plain_tensors():
                    smooth_layer(model, i, stats)
                self.convert(f"model.layers.{i}")
                bar.update()

            hooks.append(model.model.embed_tokens.register_forward_hook(lambda *_: self.convert("model.embed_tokens")))
            for i, layer in enumerate(model.model.layers):
                hooks.append(layer.register_forward_pre_hook(lambda *_, i=i: self.fill(f"model.layers.{i}")))
                hooks.append(layer.register_forward_hook(lambda *_, i=i: finish_layer(i)))
            try:
                calibration_forward(model, token_ids)()
            finally:
                for hook in hooks:
                    hook.remove()
        inside = self.seconds["read"] + self.seconds["quantize"] - inside  # the hooks' share
        self.seconds["calibrate"] += time.perf_counter() - start - inside
        model.lm_head = head
        self.fill("lm_head")
        with _plain_tensors():
            smooth_head(model, stats)
        self._convert_head()
        bar.update()
        return stats

    def _convert_head(self) -> None:
        """The final norm and LM head, then whatever a model has beyond the layers and these
        (read and cast module by module), so that nothing is left on the meta device."""
        self.fill("model.norm")
        self.fill("lm_head")
        self.convert("lm_head")
        self.convert("model.norm")
        skipped = lambda n: self.part is not None and (i := layer_index(n)) is not None and not self.part.keeps(i)  # noqa: E731
        for name in [n for n, p in self.model.named_parameters() if p.is_meta and not skipped(n)]:
            module = name.rpartition(".")[0]
            self.fill(module)
            self.convert(module)


class _RecordedHead(nn.Linear):
    """Stands in for the LM head in the calibration forward: `recording_absmax` records its input
    (all it needs of the head), and the [T, V] logits nobody reads are never computed."""

    def __init__(self, in_features: int) -> None:
        super().__init__(in_features, 1, bias=False, device="meta")  # its weight is never read

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_empty(*x.shape[:-1], 0)


@contextlib.contextmanager
def _plain_tensors():
    """Parameters made inside the calibration forward (under inference mode) as ordinary tensors,
    like those of a model loaded outside it."""
    with torch.inference_mode(False), torch.no_grad():
        yield


def calibration_forward(model: LlamaForCausalLM, token_ids: list[int]) -> Callable[[], None]:
    """One forward of `model` over `token_ids` (as many as its positions allow), every row through
    the LM head: what SmoothQuant measures activations on (`quant.smoothing`)."""

    def forward() -> None:
        ids = token_ids[: model.max_positions]
        block = 16
        runner = ModelRunner.build(model, block, None, num_blocks=(len(ids) + block - 1) // block + 1)
        table = runner.new_table()
        table.ensure_slots(len(ids))
        runner.forward([Window(table, ids, len(ids))])

    return forward


def cast_dense(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast every parameter outside the quantized linears (they keep their scales and bias)."""
    for sub in module.modules():
        if linear_kind(sub) != "dense":
            continue
        for name, param in sub.named_parameters(recurse=False):
            setattr(sub, name, torch.nn.Parameter(param.detach().to(dtype), requires_grad=False))
