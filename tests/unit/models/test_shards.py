"""Loading a sharded safetensors checkpoint one block at a time equals loading it whole."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import tiny_qwen2
from qerl_exp.config import QuantConfig
from qerl_exp.models.shards import load_blockwise, shard_files
from qerl_exp.quant import quantize_model
from qerl_exp.quant.fp4 import FP4Linear


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt")
    tiny_qwen2(vocab=256, layers=4).save_pretrained(folder, max_shard_size="300KB")  # several shards
    return folder


def test_blockwise_load_quantizes_each_block_as_it_completes_and_equals_the_whole_load(checkpoint):
    from transformers import AutoModelForCausalLM

    assert len(shard_files(checkpoint)) > 2
    seen = []

    def on_block(block):
        seen.append(block)
        assert all(isinstance(b.mlp.down_proj, FP4Linear) for b in seen[:-1])  # earlier ones already 4-bit
        assert type(block.mlp.down_proj) is nn.Linear and block.mlp.down_proj.weight.device.type == "cpu"
        quantize_model(block, QuantConfig(format="nvfp4"), torch.float32)

    streamed = load_blockwise(checkpoint, torch.float32, "cpu", on_block)
    whole = quantize_model(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval(),
                           QuantConfig(format="nvfp4"), torch.float32)
    assert len(seen) == 4
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(streamed(input_ids=ids).logits, whole(input_ids=ids).logits, rtol=0, atol=0)


def test_a_checkpoint_missing_a_tensor_is_named(checkpoint, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    last = shard_files(broken)[-1]
    tensors = load_file(str(last))
    name = sorted(tensors)[0]
    del tensors[name]
    save_file(tensors, str(last), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks 1 tensors"):
        load_blockwise(broken, torch.float32, "cpu", lambda block: None)
