""".safetensors weights through the safetensors package: every dtype it and torch both have
(the hand-written reader knew ten and refused fp8 and unsigned types), read lazily, and a
one-line error when the package is missing (issue 20)."""
from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

import zero_offload
from zero_offload.engine.model import weights_files

NAMES = ["float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
         "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "uint16", "uint32", "uint64",
         "complex64"]
DTYPES = [getattr(torch, n) for n in NAMES if hasattr(torch, n)]
CFG = {"stage": 3, "tiers": {"params": "cpu", "optimizer": "cpu", "grads": "cpu"},
       "stage3": {"unit_modules": ["Linear"]}}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Arbitrary bit patterns of `dtype` (0/1 for bool), so every byte is checked."""
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 2 if dtype == torch.bool else 256, (n,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("writer", ["safetensors.torch", "ours"])
def test_every_dtype_reads_back_bit_for_bit(tmp_path: object, writer: str) -> None:
    from safetensors.torch import save_file

    tensors = {}
    for i, dtype in enumerate(DTYPES):
        name = str(dtype).replace("torch.", "")
        tensors[f"{name}.matrix"] = _random(dtype, (3, 5), i)
        tensors[f"{name}.scalar"] = _random(dtype, (), 100 + i)
        tensors[f"{name}.empty"] = _random(dtype, (0, 4), 0)
    path = os.path.join(str(tmp_path), "all.safetensors")
    (save_file if writer == "safetensors.torch" else weights_files.save_safetensors)(tensors, path)
    got = zero_offload.engine.model.weights_files.open_weights(path)
    assert set(got) == set(tensors) and len(got) == len(tensors)
    for k, want in tensors.items():
        t = got[k]
        assert t.dtype == want.dtype and t.shape == want.shape, k
        assert torch.equal(_bytes(t), _bytes(want)), k
    assert "float8_e4m3fn.matrix" in got  # the types the old reader refused


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn], ids=str)
def test_meta_model_loads_low_precision_weights_and_integer_buffers(tmp_path: object, dtype: torch.dtype) -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)
            self.register_buffer("seen", torch.zeros((), dtype=torch.int64))
            self.register_buffer("keep", torch.ones(8, dtype=torch.bool))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.relu(self.a(x)) * self.keep).sum()

    torch.manual_seed(0)
    eager = Net()
    sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in eager.state_dict().items()}
    sd["seen"] = torch.tensor(41)
    sd["keep"] = torch.tensor([True, False] * 4)
    path = os.path.join(str(tmp_path), "w.safetensors")
    weights_files.save_safetensors(sd, path)
    with torch.device("meta"):
        model = Net()
    engine = zero_offload.initialize(model, CFG, weights=path)
    got = engine.consolidated_state_dict()
    engine.close()
    for k, v in sd.items():
        want = v.float() if v.is_floating_point() else v
        assert got[k].dtype == want.dtype and torch.equal(got[k], want), k


def test_a_missing_safetensors_package_is_one_line_and_only_for_safetensors(tmp_path: object,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    sd = nn.Linear(4, 4).state_dict()
    st, pt = os.path.join(str(tmp_path), "w.safetensors"), os.path.join(str(tmp_path), "w.pt")
    weights_files.save_safetensors(sd, st)
    torch.save(sd, pt)
    monkeypatch.setitem(sys.modules, "safetensors", None)  # `import safetensors` now raises ImportError
    with pytest.raises(ImportError, match=r"needs the safetensors package: pip install safetensors "
                                          r"\(or pip install zero_offload\[hf\]\)") as info:
        weights_files.open_weights(st)
    assert "\n" not in str(info.value)
    assert set(weights_files.open_weights(pt)) == set(sd)  # a torch file needs no safetensors


def test_a_file_that_is_not_safetensors_is_one_line(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "w.safetensors")
    with open(path, "wb") as f:
        f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(ValueError, match=f"weights file {path} is not a readable safetensors file") as info:
        weights_files.open_weights(path)
    assert "\n" not in str(info.value)
