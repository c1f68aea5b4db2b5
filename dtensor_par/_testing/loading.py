"""What loading a checkpoint costs a rank: its peak RSS rise, the bytes it reads from disk and
the bytes it holds, and the time (``tests/test_checkpoints.py``'s memory test and
``benchmarks.loading``), and of writing one back. ``python -m dtensor_par._testing.loading FOLDER
[SAVE_TO]``: one device's transformers ``from_pretrained`` of a Llama folder (and its
``save_pretrained``), measured alike, as JSON."""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch.distributed.tensor import DTensor

MIB = 2**20
KW = {"use_cache": False}
"""Llama's keyword arguments when planned: a kv cache is generate's."""


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def start_peak() -> int:
    """Reset this process's peak RSS (VmHWM) to its RSS now and return that RSS. Without the
    kernel's leave to (``clear_refs``), VmHWM stays the process's lifetime peak: a rise then
    reads larger than it was, never smaller (as ``ru_maxrss`` would)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _status("VmRSS")


def peak_rise(start: int) -> int:
    """How far the peak RSS rose above ``start`` (``start_peak``'s)."""
    return _status("VmHWM") - start


def read_bytes() -> int:
    """The bytes this process has read so far (``rchar``: ``pread`` included, from the page cache or not)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def held_bytes(model: torch.nn.Module) -> int:
    """The bytes of parameters this rank holds (its DTensor pieces; tied ones once)."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in model.parameters())


def checkpoint_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))


def llama_checkpoint(folder: str, *, hidden: int, intermediate: int, layers: int, vocab: int,
                     max_shard_size: str) -> str:
    """A transformers Llama checkpoint of random float32 weights (16 heads, 8 kv heads, untied
    head) at ``folder``, unless one is there (it is written beside it, then renamed)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if not os.path.isdir(folder):
        torch.manual_seed(0)
        config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                             num_attention_heads=16, num_key_value_heads=8, vocab_size=vocab, bos_token_id=0,
                             eos_token_id=0, tie_word_embeddings=False)
        LlamaForCausalLM(config).save_pretrained(folder + ".partial", max_shard_size=max_shard_size)
        os.replace(folder + ".partial", folder)
    return folder


def load_measured(rank: int, world: int, *, folder: str, sizes: dict, save_to: str | None = None) -> dict:
    """A rank's ``from_pretrained`` of the Llama ``folder`` over the mesh of ``sizes``, in its two
    steps: planning (built on meta and ``parallelize``d: Dynamo traces the model once) and reading
    (``load_checkpoint``: this rank's pieces). Bytes and seconds of each; the RSS rises are peaks.
    With ``save_to``: then ``save_pretrained`` there, measured alike, with the bytes of the files
    this rank wrote and of the model's largest tensor (what a writer gathers at once)."""
    from transformers import LlamaForCausalLM

    import dtensor_par
    from dtensor_par.checkpoints import empty_model, load_checkpoint

    torch._dynamo.reset()
    mesh, ids = dtensor_par.init_mesh(**sizes), torch.zeros(2, 16, dtype=torch.long)
    start, began = start_peak(), time.perf_counter()
    model = dtensor_par.parallelize(empty_model(LlamaForCausalLM, folder), mesh, (ids,), example_kwargs=KW)
    planned, plan_rise = time.perf_counter(), peak_rise(start)
    start, read = start_peak(), read_bytes()
    load_checkpoint(model, folder)
    result = {"plan_s": planned - began, "read_s": time.perf_counter() - planned, "plan_rise": plan_rise,
              "read_rise": peak_rise(start), "read_bytes": read_bytes() - read, "held_bytes": held_bytes(model),
              "checkpoint_bytes": checkpoint_bytes(folder)}
    if save_to is not None:
        torch.distributed.barrier()  # timed from when every rank is there, not from when this one finished reading
        start, began = start_peak(), time.perf_counter()
        written = dtensor_par.save_pretrained(model, save_to)
        result.update(save_s=time.perf_counter() - began, save_rise=peak_rise(start),
                      written_bytes=sum(os.path.getsize(f) for f in written),
                      largest_bytes=max(t.numel() * t.element_size() for t in model.state_dict().values()))
    return result


def one_device(folder: str, save_to: str | None = None) -> dict:
    """transformers' own ``from_pretrained`` of ``folder`` in this process, then every parameter
    read once (transformers 5 returns float32 weights of a float32 file mapped, not read: their
    pages come in at first use): seconds, peak RSS rise and bytes read of each. With ``save_to``:
    then its own ``save_pretrained`` there, seconds and peak RSS rise."""
    from transformers import LlamaForCausalLM

    start, read, began = start_peak(), read_bytes(), time.perf_counter()
    model = LlamaForCausalLM.from_pretrained(folder)
    loaded, rise, read_loading = time.perf_counter(), peak_rise(start), read_bytes() - read
    with torch.no_grad():
        for p in model.parameters():
            p.sum()
    result = {"seconds": loaded - began, "rise": rise, "read_bytes": read_loading, "held_bytes": held_bytes(model),
              "touched_s": time.perf_counter() - began, "touched_rise": peak_rise(start)}
    if save_to is not None:
        start, began = start_peak(), time.perf_counter()
        model.save_pretrained(save_to)
        result.update(save_s=time.perf_counter() - began, save_rise=peak_rise(start))
    return result


if __name__ == "__main__":
    print(json.dumps(one_device(*sys.argv[1:3])))
