"""Greedy decoding with a kv cache: tokens per second and kv cache bytes per rank of a 2-layer
transformers Llama at a cache of 4096 positions, tp=2 and ring=2 against one device.

    python -m benchmarks.decode [--quick] [--cache 4096] [--steps 32] [--mesh tp=2 ring=2] [--json out.json]

``LlamaForCausalLM`` (2 layers, hidden 256, 8 heads, 4 kv heads, mlp 768, vocab 512, fp32,
random weights, eval, no_grad) prefills a prompt of ``--cache`` tokens into a
``DynamicCache``, then decodes greedily: ``--warmup`` steps (the decode graph compiles) and
``--steps`` timed ones, each a call of the compiled ``model.forward`` with one token and
``use_cache=True``. One device: ``torch.compile(model.forward, backend=inner)`` on one
process; a mesh: ``hybrid_parallel(mesh, inner_backend=inner)`` on gloo ranks (one thread
each, parameters whole: sliced per call). Tokens/s: timed steps over the slowest rank's
seconds. Kv cache bytes per rank: keys + values of every layer after the prefill, this
rank's piece (``CacheShard.local``, the cache itself holds stand-ins), the largest over
ranks. Every mesh must decode one device's tokens. A mesh that fails is a row saying why.
"""

from __future__ import annotations

import argparse
import math
import time
import traceback

import torch
import torch.distributed as dist

import dtensor_par
from benchmarks.report import failure, save_json, table
from dtensor_par.kv_cache import cache_shard
from dtensor_par._testing.harness import run_ranks

FULL = {"sizes": {"layers": 2, "hidden": 256, "heads": 8, "kv_heads": 4, "mlp": 768, "vocab": 512},
        "cache": 4096, "steps": 32, "warmup": 2, "meshes": ["tp=2", "ring=2"], "backend": "aot_eager"}
QUICK = {"sizes": {"layers": 2, "hidden": 64, "heads": 8, "kv_heads": 4, "mlp": 128, "vocab": 128},
         "cache": 64, "steps": 4, "warmup": 2, "meshes": ["tp=2"], "backend": "eager"}


def parse_mesh(text: str) -> dict[str, int]:
    """``"tp=2"`` or ``"tp=2,ring=2"`` as ``init_mesh``'s sizes; ``""``: one device."""
    return {d: int(n) for d, n in (part.split("=") for part in text.split(",") if part)}


def _model(sizes: dict, positions: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=sizes["vocab"], hidden_size=sizes["hidden"], intermediate_size=sizes["mlp"],
                         num_hidden_layers=sizes["layers"], num_attention_heads=sizes["heads"],
                         num_key_value_heads=sizes["kv_heads"], max_position_embeddings=positions)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval(), config


def cache_bytes(cache) -> int:
    """Bytes of keys and values this rank holds: a stand-in's shard, else the tensor itself."""
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    return sum((cache_shard(t).local if cache_shard(t) is not None else t).nbytes for t in tensors)


def _greedy(model, ids, cache) -> torch.Tensor:
    """The token after ``ids`` (the cache holding what came before them), ``(1, 1)``."""
    return model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)


@torch.no_grad()
def _decode(rank: int, world: int, *, mesh: str, sizes: dict, cache: int, steps: int, warmup: int,
            backend: str) -> dict:
    """This rank's prefill, warm-up and timed decode steps: its tokens, seconds and cache bytes."""
    from transformers import DynamicCache

    model, config = _model(sizes, cache + warmup + steps + 1)
    ids = torch.randint(0, sizes["vocab"], (1, cache))
    compiler = dtensor_par.hybrid_parallel(dtensor_par.init_mesh(**parse_mesh(mesh)), inner_backend=backend) \
        if mesh else backend
    model.forward = torch.compile(model.forward, backend=compiler)
    kv = DynamicCache(config=config)
    tokens = [_greedy(model, ids, kv)]
    held = cache_bytes(kv)
    for _ in range(warmup):
        tokens.append(_greedy(model, tokens[-1], kv))
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        tokens.append(_greedy(model, tokens[-1], kv))
    seconds = time.perf_counter() - start
    return {"tokens": torch.cat(tokens, 1).tolist(), "seconds": seconds, "cache_bytes": held,
            "cache_length": cache, "final_cache_length": kv.get_seq_length()}


def _recorded(rank: int, world: int, **kwargs) -> dict:
    """``_decode``, or the error it raised: one mesh's failure is a row, not the end of the table."""
    try:
        return _decode(rank, world, **kwargs)
    except Exception as e:  # noqa: BLE001  recorded in the table, never hidden
        traceback.print_exc()
        return {"error": failure(e)}


def _variant(mesh: str, **kwargs) -> dict:
    """One variant on its own launch: every rank's result folded into one row."""
    world = math.prod(parse_mesh(mesh).values())
    try:
        ranks = run_ranks(world, _recorded, mesh=mesh, **kwargs)
    except Exception as e:  # noqa: BLE001  a rank that died
        ranks = [{"error": failure(e)}]
    row = {"mesh": mesh or "one device", "ranks": world}
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        return {**row, "error": errors[0]}
    first, seconds = ranks[0], max(r["seconds"] for r in ranks)
    return {**row, "cache_length": first["cache_length"], "final_cache_length": first["final_cache_length"],
            "steps": kwargs["steps"], "seconds": seconds, "tokens_per_s": kwargs["steps"] / seconds,
            "cache_bytes_per_rank": max(r["cache_bytes"] for r in ranks),
            "tokens": first["tokens"], "ranks_agree": all(r["tokens"] == first["tokens"] for r in ranks)}


def measure(meshes: list[str], **kwargs) -> list[dict]:
    """One device, then each mesh, each against one device's tokens and bytes."""
    rows = [_variant(mesh, **kwargs) for mesh in ["", *meshes]]
    one = rows[0]
    for r in rows:
        if "error" not in r and "error" not in one:
            r["tokens_equal_one_device"] = r["ranks_agree"] and r["tokens"] == one["tokens"]
            r["speedup"] = r["tokens_per_s"] / one["tokens_per_s"]
            r["cache_bytes_ratio"] = r["cache_bytes_per_rank"] / one["cache_bytes_per_rank"]
    return rows


COLUMNS = ["variant", "ranks", "cache length", "timed steps", "tokens/s", "ms/token", "vs one device",
           "kv cache MiB/rank", "kv bytes vs one device", "tokens = one device"]


def _cells(r: dict) -> list:
    if "error" in r:
        return [r["mesh"], r["ranks"], f"error: {r['error']}", *[""] * (len(COLUMNS) - 3)]
    equal = {True: "yes", False: "NO"}.get(r.get("tokens_equal_one_device"), "-")
    return [r["mesh"], r["ranks"], r["cache_length"], r["steps"], f"{r['tokens_per_s']:.1f}",
            f"{1e3 / r['tokens_per_s']:.1f}", f"{r['speedup']:.2f}" if "speedup" in r else "-",
            f"{r['cache_bytes_per_rank'] / 2**20:.2f}",
            f"{r['cache_bytes_ratio']:.3f}" if "cache_bytes_ratio" in r else "-", equal]


def report(setup: dict) -> dict:
    """The decode section: its table as text, and its rows."""
    rows = measure(setup["meshes"], sizes=setup["sizes"], cache=setup["cache"], steps=setup["steps"],
                   warmup=setup["warmup"], backend=setup["backend"])
    s = setup["sizes"]
    note = (f"transformers LlamaForCausalLM, {s['layers']} layers, hidden {s['hidden']}, {s['heads']} heads, "
            f"{s['kv_heads']} kv heads, mlp {s['mlp']}, vocab {s['vocab']}, fp32; prefill {setup['cache']} tokens, "
            f"{setup['warmup']} warm-up and {setup['steps']} timed greedy steps; inner backend {setup['backend']}; "
            "gloo ranks on CPU, one thread each")
    return {"text": note + "\n" + table(COLUMNS, [_cells(r) for r in rows]), "rows": rows, "setup": setup}


def section(quick: bool) -> dict:
    """``python -m benchmarks``'s decode section: the full setup, or a line in ``--quick``."""
    if quick:
        return {"text": "skipped in --quick (python -m benchmarks.decode --quick is its smoke run)", "rows": []}
    return report(FULL)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, cache 64, tp=2 only, inner backend eager")
    parser.add_argument("--cache", type=int, help="prefill length: the cache's positions before decoding")
    parser.add_argument("--steps", type=int, help="timed decode steps")
    parser.add_argument("--warmup", type=int, help="decode steps before the timed ones (they compile)")
    parser.add_argument("--mesh", nargs="+", help="meshes to run, each like tp=2 or tp=2,ring=2")
    parser.add_argument("--backend", help="inner backend, and the one device's torch.compile backend")
    parser.add_argument("--json", help="also write the measurements here")
    args = parser.parse_args()
    given = {"cache": args.cache, "steps": args.steps, "warmup": args.warmup, "meshes": args.mesh,
             "backend": args.backend}
    setup = {**(QUICK if args.quick else FULL), **{k: v for k, v in given.items() if v is not None}}
    result = report(setup)
    print(result["text"])
    save_json(args.json, result)


if __name__ == "__main__":
    main()
