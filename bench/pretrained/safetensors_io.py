"""The safetensors format read and written by plain PyTorch (hf_reference.py's files): an
8-byte little-endian header size, a JSON header of names, dtypes, shapes and byte offsets, then
the tensors' bytes. Neither transformers nor the safetensors package is needed."""
import json
import struct

import torch

DTYPES = {"F32": torch.float32, "F64": torch.float64, "F16": torch.float16,
          "BF16": torch.bfloat16, "I64": torch.int64}
NAMES = {v: k for k, v in DTYPES.items()}


def save_safetensors(path, tensors, metadata=None):
    header, offset, blobs = {}, 0, []
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        data = t.view(torch.uint8).numpy().tobytes() if t.dtype == torch.bfloat16 else t.numpy().tobytes()
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def load_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + size])
    data, out = raw[8 + size:], {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        begin, end = e["data_offsets"]
        dtype = DTYPES[e["dtype"]]
        buf = bytearray(data[begin:end])
        if dtype == torch.bfloat16:
            t = torch.frombuffer(buf, dtype=torch.int16).view(torch.bfloat16)
        else:
            t = torch.frombuffer(buf, dtype=dtype)
        out[name] = t.reshape(e["shape"]).clone()
    return out
