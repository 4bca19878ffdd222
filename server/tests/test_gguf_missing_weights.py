"""A GGUF file that lacks a tensor is refused by name, not served with that weight at random.

transformers' GGUF reader (which native models' GGUF loads go through, `models/loader.py`) fills
the weights a file lacks at random and only warns; the loaded state dict then passes the native
loader's completeness check. The file here is the shipped SmolLM2 GGUF, copied with one tensor
left out (its metadata and every other tensor as they are).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from tgserve.server.config.engine_args import EngineArgs
from tgserve.server.engine.llm_engine import LLMEngine
from tgserve.server.loading.default_model import default_model_gguf
from tgserve.server.loading.errors import ModelLoadError


def copy_without(source: Path, target: Path, dropped: str) -> None:
    """`source` rewritten to `target` without the tensor named `dropped`."""
    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(target, arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer writes these itself
        kind = field.types[0]
        sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub_type)
    kept = [tensor for tensor in reader.tensors if tensor.name != dropped]
    assert len(kept) == len(reader.tensors) - 1, f"{dropped} is not in {source.name}"
    for tensor in kept:
        writer.add_tensor_info(
            tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in kept:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
    writer.close()


def test_a_gguf_that_lacks_a_tensor_is_refused_by_name(tmp_path):
    source = default_model_gguf()
    target = tmp_path / source.name
    copy_without(source, target, "blk.3.ffn_up.weight")
    with pytest.raises(ModelLoadError, match=r"lacks 1 weights .*model\.layers\.3\.mlp\.up_proj\.weight"):
        LLMEngine(EngineArgs(model=str(target), dtype="float32", device="cpu"))
