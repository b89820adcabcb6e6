#!/usr/bin/env python3
"""LoRA adapters in Hugging Face PEFT's format, written and applied by PyTorch alone.

PEFT's LoRA (peft/tuners/lora/layer.py) adds scaling * B A to a module's weight, scaling being
lora_alpha / r (lora_alpha / sqrt(r) with use_rslora); its files are adapter_config.json and
adapter_model.safetensors with "base_model.model.<module>.lora_A.weight" [r, in] and
"...lora_B.weight" [out, r]. GPT-2's Conv1D modules hold their weight [in, out] (fan_in_fan_out),
so the update is added transposed. Neither peft nor transformers is needed: the models are
hf_reference.py's.

  peft_reference.py write BASE OUT R ALPHA MODULE...  # OUT: random A and B for every module whose
                                                      # name ends with a MODULE, as PEFT writes them,
                                                      # and logits.safetensors: BASE's fixed tokens
                                                      # through BASE + the adapters, in float64
  peft_reference.py check BASE ADAPTER                # ADAPTER (saved elsewhere, with its
                                                      # logits.safetensors) applied to BASE here:
                                                      # max relative difference of the logits
"""
import json
import math
import os
import sys

import torch

from hf_reference import fixed_tokens, load_checkpoint
from safetensors_io import load_safetensors, save_safetensors

PREFIX = "base_model.model."


def scaling(config):
    r, alpha = config["r"], config["lora_alpha"]
    return alpha / math.sqrt(r) if config.get("use_rslora", False) else alpha / r


def apply(model, adapter_dir):  # the base's weights plus every adapter's update, in float64
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        config = json.load(f)
    tensors = load_safetensors(os.path.join(adapter_dir, "adapter_model.safetensors"))
    model = model.double()
    state = dict(model.named_parameters())
    conv1d = config.get("fan_in_fan_out", False)
    with torch.no_grad():
        for name, a in tensors.items():
            if not name.endswith(".lora_A.weight"):
                continue
            module = name[len(PREFIX):-len(".lora_A.weight")]
            b = tensors[name.replace("lora_A", "lora_B")]
            delta = scaling(config) * (b.double() @ a.double())
            weight = state[module + ".weight"]
            weight.add_(delta.t() if conv1d else delta)
    return model


def write(base, out, r, alpha, modules):
    model = load_checkpoint(base)
    with open(os.path.join(base, "config.json")) as f:
        gpt2 = json.load(f)["model_type"] == "gpt2"
    g = torch.Generator().manual_seed(77)
    tensors, chosen = {}, set()
    for name, p in model.named_parameters():
        module = name[:-len(".weight")] if name.endswith(".weight") else None
        if module is None or not any(module == m or module.endswith("." + m) for m in modules):
            continue
        fan_in, fan_out = (p.shape[0], p.shape[1]) if gpt2 else (p.shape[1], p.shape[0])
        bound = 1 / math.sqrt(fan_in)
        tensors[PREFIX + module + ".lora_A.weight"] = (torch.rand(r, fan_in, generator=g) * 2 - 1) * bound
        tensors[PREFIX + module + ".lora_B.weight"] = torch.randn(fan_out, r, generator=g) * 0.05
        chosen.add(module.split(".")[-1])
    os.makedirs(out, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha,
              "lora_dropout": 0.0, "use_rslora": False, "target_modules": sorted(chosen),
              "base_model_name_or_path": os.path.basename(base.rstrip("/")), "bias": "none",
              "fan_in_fan_out": gpt2, "inference_mode": True, "modules_to_save": None}
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_safetensors(os.path.join(out, "adapter_model.safetensors"), tensors, {"format": "pt"})
    with open(os.path.join(base, "config.json")) as f:
        tokens = fixed_tokens(json.load(f)["vocab_size"])
    with torch.no_grad():
        logits = apply(model, out)(tokens)
    save_safetensors(os.path.join(out, "logits.safetensors"), {"tokens": tokens, "logits": logits})
    print(f"wrote {out}: {len(tensors) // 2} adapters of rank {r}")


def check(base, adapter):
    expected = load_safetensors(os.path.join(adapter, "logits.safetensors"))
    with torch.no_grad():
        logits = apply(load_checkpoint(base), adapter)(expected["tokens"])
    want = expected["logits"].double()
    diff = ((logits - want).abs().max() / want.abs().max()).item()
    print(f"{adapter}: max |PyTorch - weave| / max |logits| = {diff:.3g}")
    sys.exit(0 if diff < 1e-5 else 1)


if __name__ == "__main__":
    if len(sys.argv) >= 6 and sys.argv[1] == "write":
        write(sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]), sys.argv[6:])
    elif len(sys.argv) == 4 and sys.argv[1] == "check":
        check(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
